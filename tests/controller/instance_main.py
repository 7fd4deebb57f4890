"""An engine instance in its own process, driven by a test over stdin/stdout (one JSON per line).

    python -m tests.controller.instance_main MODEL_DIR '{"chunk_size": 16, "controller_url": ...}'

The bundled engine (``kvlayer.engine.LLM``, its own prefix cache off) runs with kvlayer and
its controller agent. Once up it prints ``{"ready": true}``; then each request line gets one
answer line:

- ``{"op": "generate", "prompt": [ids], "max_tokens": 6, "salt": null}`` -> ``{"tokens": [ids],
  "external": n}`` (greedy; background tier writes are flushed before answering, so the tiers
  are settled; a ``salt`` is the request's ``cache_salt``);
- ``{"op": "holds", "prompt": [ids]}`` -> ``{"tokens": n, "tiers": {tier: n}}``: the prefix
  tokens this instance really holds, in its tiers together and in each tier by itself;
- ``{"op": "stats"}`` -> kvlayer's per-tier counters; ``{"op": "agent"}`` -> the agent's state;
- ``{"op": "exit"}`` closes the engine and exits.

Errors answer ``{"error": "..."}``. Logs go to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from kvlayer.engine import LLM, SamplingParams

Request = dict[str, Any]


class Instance:
    """The engine and the operations a test may ask of it."""

    def __init__(self, model: str, kv_config: dict[str, Any]) -> None:
        self.llm = LLM(model, num_gpu_blocks=256, enable_prefix_caching=False, kv_config=kv_config)
        self.connector = self.llm.engine.connector
        self.kv = self.connector.kv
        self.ops: dict[str, Callable[[Request], Any]] = {
            "generate": self.generate, "holds": self.holds, "stats": lambda r: self.kv.stats(),
            "agent": self.agent,
        }

    def generate(self, request: Request) -> dict[str, Any]:
        params = SamplingParams(max_tokens=request.get("max_tokens", 6), temperature=0.0, ignore_eos=True)
        prompt: dict[str, Any] = {"prompt_token_ids": request["prompt"]}
        if request.get("salt") is not None:
            prompt["cache_salt"] = request["salt"]
        out = self.llm.generate([prompt], params)[0]
        self.kv.flush()
        return {"tokens": list(out.outputs[0].token_ids), "external": out.num_external_tokens}

    def holds(self, request: Request) -> dict[str, Any]:
        keys = self.kv.keys(request["prompt"])
        tiers = {}
        for backend in self.kv.backends:
            n = self.kv.loop.run(backend.contains_prefix(keys), 10.0)
            tiers[backend.name] = keys[n - 1].end if n else 0
        return {"tokens": self.kv.lookup(request["prompt"]).num_tokens, "tiers": tiers}

    def agent(self, request: Request) -> dict[str, Any]:
        agent = self.connector.agent
        return {"connected": agent.connected, "registrations": agent.registrations}

    def close(self) -> None:
        self.llm.close()


def main() -> None:
    instance = Instance(sys.argv[1], json.loads(sys.argv[2]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        try:
            answer = instance.ops[request["op"]](request)
        except Exception as e:  # the test sees it in the answer
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    instance.close()


if __name__ == "__main__":
    main()
