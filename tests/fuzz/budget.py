"""How much each fuzz test explores: a bounded share in CI, the full count under ``-m slow``.

A fuzz test takes ``examples`` from ``@budget(ci=N)`` (two test ids: ``[ci]`` runs N examples
in every run, ``[full]`` is marked slow and runs ``FULL``) and hands it to ``explore`` with
its property and strategies. Every run is reproducible (derandomized, no example database) and
has no deadline (the machine is shared). Run the full counts::

    .venv/bin/python -m pytest -m slow tests/fuzz
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.strategies import SearchStrategy

FULL = 10_000
"""Generated inputs per fuzz test under ``-m slow`` (issue 25: at least 10,000 each)."""


def budget(ci: int) -> pytest.MarkDecorator:
    """Parametrize a test's ``examples``: ``ci`` in CI, ``FULL`` under ``-m slow``."""
    return pytest.mark.parametrize("examples", [pytest.param(ci, id="ci"),
                                                pytest.param(FULL, id="full", marks=pytest.mark.slow)])


def fuzz_settings(examples: int) -> settings:
    """``examples`` examples, reproducible, nothing written to disk, no deadline or size health checks."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example, HealthCheck.filter_too_much])


def explore(examples: int, check: Callable[..., None], *strategies: SearchStrategy[Any], **fixed: Any) -> None:
    """Run ``check`` on ``examples`` generated inputs: its last arguments drawn from
    ``strategies``, its first ones the ``fixed`` keywords (a server, a client). Hypothesis shrinks
    and reports the first failing input; ``check`` may carry ``@example`` regressions."""
    fuzz_settings(examples)(given(*strategies)(check))(**fixed)
