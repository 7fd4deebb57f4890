"""Fixtures of the ``kvlayer serve`` tests: model folders, an in-process reference engine, helpers."""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from kvlayer.engine import LLM, SamplingParams


def greedy(llm: LLM, prompts: list, max_tokens: int) -> list[list[int]]:
    """The greedy tokens of ``prompts`` (texts or token-id lists), EOS ignored."""
    items = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(items, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def random_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="session")
def no_tokenizer_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model without tokenizer.json: token ids only."""
    folder = tmp_path_factory.mktemp("tiny-no-tokenizer")
    for f in Path(tiny_model_dir).iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, folder / f.name)
    return str(folder)


def write_kv_config(folder: Path, **keys: object) -> str:
    path = folder / "kvlayer.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()), encoding="utf-8")
    return str(path)


def metric(url: str, name: str) -> float:
    """The value of series ``name`` (exact name with labels, e.g. 'x_total{a="b"}') on /metrics; 0 if absent."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_until_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and nothing is held; returns the gauges."""
    names = ("kvlayer_serve_requests_running", "kvlayer_serve_requests_waiting", "kvlayer_serve_kv_blocks_in_use",
             "kvlayer_serve_connector_requests", "kvlayer_serve_borrowed_chunks")
    deadline = time.monotonic() + timeout
    while True:
        values = {n: metric(url, n) for n in names}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


MAX_MODEL_LEN = 2048
BODY_LIMIT = 65536


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One ``kvlayer serve`` on the tiny model, with its tokenizer, the engine's prefix cache and
    kvlayer's CPU tier (chunks of 16 tokens); shared by the modules that only send requests."""
    from tests.serve_process import ServeProcess

    config = write_kv_config(tmp_path_factory.mktemp("serve-kv"), cpu_capacity="32MiB", chunk_size=16)
    with ServeProcess(tiny_model_dir, "--kv-config", config, "--kv-cache-memory", "64MiB",
                      "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(BODY_LIMIT)) as proc:
        yield proc
