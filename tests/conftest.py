"""Fixtures shared by the whole suite: tiny random-weight models made once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama model folder (2 layers, 2 KV heads, head_dim 16, vocab 512)."""
    from kvlayer.engine.presets import init_model

    return str(init_model("tiny", tmp_path_factory.mktemp("tiny-llama"), seed=0))


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """The tiny model in-process, without kvlayer: the tokens every served answer must equal."""
    from kvlayer.engine import LLM

    with LLM(tiny_model_dir, num_gpu_blocks=512) as llm:
        yield llm
