"""Fixtures of the fuzz tests (how much each explores: ``budget.py``).

``http_app``: the application of ``kvlayer serve`` on the tiny model with kvlayer's CPU tier,
in process (httpx's ASGI transport, no socket), so thousands of requests cost milliseconds
each; its engine loop runs on its own thread as in the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

MAX_MODEL_LEN = 128
"""Small, so that no request the fuzz makes can generate for long."""
BODY_LIMIT = 65536
MODEL = "fuzz-model"
"""The served model name."""


class AppClient:
    """Requests to the app, each on one private event loop, within ``timeout_s`` (a hang fails)."""

    def __init__(self, app: object, timeout_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, content: bytes, headers: dict[str, str] | None = None
                ) -> httpx.Response:
        call = self.client.request(method, path, content=content, headers=headers)
        try:
            return self.loop.run_until_complete(asyncio.wait_for(call, self.timeout_s))
        except TimeoutError:
            raise AssertionError(f"{method} {path} {content[:200]!r} hung for {self.timeout_s} s") from None

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def http_app(tiny_model_dir: str) -> Iterator[AppClient]:
    from kvlayer.engine.llm import LLM
    from kvlayer.serving.app import build_app
    from kvlayer.serving.chat import ChatTemplate
    from kvlayer.serving.completions import ServerState
    from kvlayer.serving.engine_loop import AsyncEngine
    from kvlayer.serving.metrics import ServingMetrics

    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN,
              kv_config={"cpu_capacity": "8MiB", "chunk_size": 16})
    engine = llm.engine
    loop = AsyncEngine(engine)
    state = ServerState(loop, MODEL, engine.tokenizer, ChatTemplate.from_dir(tiny_model_dir),
                        ServingMetrics(engine.connector.kv.metrics), engine.model_config.vocab_size,
                        engine.max_model_len)
    client = AppClient(build_app(state, (), BODY_LIMIT), timeout_s=30.0)
    loop.start()  # the transport does not run the app's lifespan, which would
    try:
        yield client
    finally:
        client.loop.run_until_complete(loop.shutdown())
        client.close()
