"""SIGTERM: ``kvlayer serve`` finishes what runs, flushes kvlayer's writes and exits 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx

from tests.serve_process import ServeProcess
from tests.serving.conftest import random_ids, write_kv_config


def chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_sigterm_drains_flushes_and_exits_0(no_tokenizer_model, tmp_path):
    nvme = tmp_path / "nvme"
    config = write_kv_config(tmp_path, cpu_capacity="32MiB", chunk_size=16, nvme_path=str(nvme))
    args = ("--kv-config", config, "--no-prefix-caching", "--served-model-name", "tiny", "--kv-cache-memory", "64MiB")
    stored = random_ids(100, seed=31)
    body = {"model": "tiny", "prompt": stored, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    server = ServeProcess(no_tokenizer_model, *args).start()
    try:
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        streamed = {"model": "tiny", "prompt": random_ids(40, seed=32), "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
        tokens, lines = [], []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 1:
                    server.proc.send_signal(signal.SIGTERM)  # mid-stream
                if line != "data: [DONE]":
                    tokens += json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"]
        assert lines[-1] == "data: [DONE]" and len(tokens) == 300, "the running request must finish"
        assert server.terminate() == 0, server.log()
    finally:
        server.kill()
    assert "Traceback" not in server.log(), server.log()
    assert len(chunk_files(nvme)) >= 6 + 2, "the prompts' chunks must be on disk after the exit"

    with ServeProcess(no_tokenizer_model, *args) as again:  # a fresh process reads them back
        answer = httpx.post(f"{again.url}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
