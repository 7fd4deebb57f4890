"""An engine's KV-cache groups (kvlayer/cache_groups.py): what the step layer reads from them."""

from __future__ import annotations

import pytest

from kvlayer.cache_groups import KVCacheGroups, released_before


def test_a_hybrids_groups_give_each_layers_group_and_each_groups_window() -> None:
    groups = KVCacheGroups((0, 1, 0, 1), (None, 256, None, 256))
    assert groups.num_groups == 2
    assert groups.grouped == (0, 1, 0, 1) and groups.group_windows == (None, 256)
    assert groups.layer_windows == (None, 256, None, 256)


def test_one_full_attention_group_is_one_block_table_and_no_window() -> None:
    groups = KVCacheGroups((0, 0, 0), (None, None, None))
    assert groups.grouped == () and groups.layer_windows == () and groups.group_windows == (None,)
    with pytest.raises(ValueError, match="3 layer groups for 2 layer windows"):
        KVCacheGroups((0, 0, 0), (None, None))


def test_a_window_releases_the_blocks_it_no_longer_attends_to() -> None:
    assert released_before((None, 256), 100) == [0, 0]
    assert released_before((None, 256), 1000) == [0, 745], "tokens before computed - window + 1"
