"""LLMEngine.abort_request: a request stopped between steps gives back its blocks and kvlayer state."""

from __future__ import annotations

from kvlayer.engine import LLM, SamplingParams

LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def in_use(engine) -> int:
    return engine.num_blocks - engine.block_manager.num_free_blocks


def borrowed(llm) -> int:
    return sum(t["backend"]["borrowed"] for t in llm.kv_stats()["tiers"].values())


def test_abort_running_and_waiting_requests_frees_everything(tiny_model_dir):
    with LLM(tiny_model_dir, num_gpu_blocks=64, max_num_seqs=1,
             kv_config={"cpu_capacity": "16MiB", "chunk_size": 16}) as llm:
        engine = llm.engine
        prompt = {"prompt_token_ids": list(range(3, 60))}
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # stored in kvlayer
        llm.reset_prefix_cache()
        running = engine.add_request(prompt, LONG)  # hits kvlayer's chunks
        waiting = engine.add_request({"prompt_token_ids": list(range(100, 140))}, LONG)
        outs = engine.step() + engine.step()
        assert [o.request_id for o in outs] == [running, running] and engine.num_waiting == 1
        assert outs[0].num_external_tokens == 48
        assert in_use(engine) > 0 and engine.connector.num_tracked_requests >= 1

        assert engine.abort_request(running) and engine.abort_request(waiting)
        assert not engine.abort_request(running), "an aborted request is no longer unfinished"
        assert not engine.has_unfinished_requests()
        assert in_use(engine) == 0
        assert engine.connector.num_tracked_requests == 0
        assert borrowed(llm) == 0
        assert engine.step() == []

        again = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        fresh = LLM(tiny_model_dir, num_gpu_blocks=64).generate(
            [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_abort_unknown_request_is_false(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_gpu_blocks=16)
    assert llm.engine.abort_request("nope") is False
