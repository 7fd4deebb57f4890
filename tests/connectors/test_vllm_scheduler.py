"""The vLLM connector's scheduler side (connectors/vllm_scheduler.py) on hand-made scheduler
outputs, without vLLM: block-aligned hits, loads and saves per step, preemption, failed loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvlayer.config import KVLayerConfig
from kvlayer.connectors.vllm_scheduler import REUSE_LOOKUP_S, RankedLookups, SchedulerSide

BS, CHUNK = 4, 8


@dataclass
class FakeLookups:
    found: int = 0
    asked: list = field(default_factory=list)

    def lookup(self, token_ids, salt, *, request_id="", start=0, limit=None):
        self.asked.append((list(token_ids), salt))
        found = min(self.found, len(token_ids) if limit is None else limit)
        return found, (0,) * (found // CHUNK)


def request(rid: str, n: int, salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(100, 100 + n)), num_prompt_tokens=n,
                           cache_salt=salt)


def output(new=(), cached=(), scheduled=None, finished=(), preempted=(), resumed=()) -> SimpleNamespace:
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[
            None if b is None else (b,) for _, b, _ in cached], num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(resumed)),
        num_scheduled_tokens=scheduled or {}, finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def side(found: int) -> tuple[SchedulerSide, FakeLookups]:
    lookups = FakeLookups(found)
    return SchedulerSide(KVLayerConfig(chunk_size=CHUNK, cpu_capacity=0), lookups, BS), lookups


def test_a_hit_is_whole_blocks_after_vllms_own_and_never_the_last_token() -> None:
    s, lookups = side(found=16)
    r = request("a", 16, salt="t")
    assert s.matched(r, 0) == 12, "16 found, the last token kept: 15, down to whole blocks"
    assert lookups.asked[-1] == (list(range(100, 116)), "t")
    assert s.matched(r, 8) == 4, "vLLM's own 8 first"
    s2, _ = side(found=0)
    assert s2.matched(request("b", 16), 0) == 0


def test_a_waiting_request_is_looked_up_once_per_interval(monkeypatch) -> None:
    from kvlayer import requests

    clock = [100.0]
    monkeypatch.setattr(requests.time, "monotonic", lambda: clock[0])
    s, lookups = side(found=16)
    r = request("a", 20)
    for _ in range(5):  # vLLM asks at every step while the request waits
        assert s.matched(r, 0) == 16
    assert len(lookups.asked) == 1
    clock[0] += REUSE_LOOKUP_S
    lookups.found = 8
    assert s.matched(r, 0) == 8 and len(lookups.asked) == 2, "a stale answer is asked again"
    s.allocated(r, [1, 2, 3, 4, 5], 8)
    assert s.matched(r, 0) == 8 and len(lookups.asked) == 3, "after an allocation, asked again"
    r.all_token_ids.append(7)
    s.matched(r, 0)
    assert len(lookups.asked) == 4, "more tokens, asked again"


def test_a_step_lists_the_granted_load_and_the_chunks_it_completes() -> None:
    s, _ = side(found=16)
    r = request("a", 20)
    assert s.matched(r, 0) == 16
    s.allocated(r, [7, 3, 9, 1, 5], 16)
    meta = s.build(output(new=[("a", [7, 3, 9, 1, 5], 16)], scheduled={"a": 4}))
    (load,) = meta.loads
    assert (load.start, load.end, load.block_ids, load.token_ids) == (0, 16, (7, 3, 9, 1), tuple(range(100, 116)))
    (save,) = meta.saves
    assert (save.first, len(save.token_ids), save.block_ids) == (0, 16, (7, 3, 9, 1)), "20 computed: 2 full chunks"
    again = s.build(output(cached=[("a", [2], 20)], scheduled={"a": 1}))
    assert again.loads == () and again.saves == (), "a load is granted once; nothing new completes"


def test_a_resumed_request_gets_its_new_blocks_and_keeps_what_it_saved() -> None:
    s, _ = side(found=0)
    r = request("a", 24)
    s.matched(r, 0)
    s.allocated(r, [1, 2, 3, 4, 5, 6], 0)
    first = s.build(output(new=[("a", [1, 2, 3, 4, 5, 6], 0)], scheduled={"a": 12}))
    assert [sv.block_ids for sv in first.saves] == [(1, 2)]
    s.build(output(preempted=["a"]))
    resumed = s.build(output(cached=[("a", [8, 9, 10, 11, 12, 13], 0)], scheduled={"a": 24}, resumed=["a"]))
    (save,) = resumed.saves
    assert (save.first, save.block_ids) == (8, (8, 9, 10, 11, 12, 13)), "saved from where it was, in the new blocks"


def test_failed_blocks_are_saved_again_once_recomputed() -> None:
    s, _ = side(found=0)
    r = request("a", 32)
    s.matched(r, 0)
    s.allocated(r, [1, 2, 3, 4, 5, 6, 7, 8], 0)
    s.build(output(new=[("a", [1, 2, 3, 4, 5, 6, 7, 8], 0)], scheduled={"a": 32}))
    s.load_failed({6})  # block index 5: tokens 20.. are bad, so chunks from token 16 on
    meta = s.build(output(cached=[("a", None, 32)], scheduled={"a": 1}))
    (save,) = meta.saves
    assert save.first == 16 and len(save.token_ids) == 32
    s.finished("a")
    assert s.build(output(cached=[("a", None, 33)], scheduled={"a": 1})).saves == ()


@dataclass
class RankLookups:
    answer: tuple
    reachable: bool = True
    asked: int = 0

    def send(self, token_ids, salt, *, request_id="", start=0, limit=None):
        self.asked += self.reachable
        return self.reachable

    def receive(self, asked):
        return self.answer


def test_every_rank_is_asked_and_the_fewest_tokens_win() -> None:
    def ranked(*ranks):
        return RankedLookups(list(ranks)).lookup([1] * 20, None)

    assert ranked(RankLookups((16, (0, 2))), RankLookups((16, (0, 2)))) == (16, (0, 2)), "agreeing ranks keep tiers"
    assert ranked(RankLookups((16, (0, 2))), RankLookups((8, (1,)))) == (8, ()), "the fewest; each worker finds its own"
    assert ranked(RankLookups((16, (0, 0))), RankLookups((16, (0, 2)))) == (16, ())
    misses = [RankLookups((0, ())), RankLookups((16, (0, 2)))]
    assert ranked(*misses) == (0, ()) and [r.asked for r in misses] == [1, 1], "asked at once, a miss wins"
    assert ranked(RankLookups((16, (0, 2))), RankLookups((16, (0, 2)), reachable=False)) == (0, ()), \
        "a rank that cannot be asked is a miss"
    with pytest.raises(ValueError, match="at least one rank"):
        RankedLookups([])


def test_a_reset_gives_every_request_a_new_salt_and_tells_the_workers_once() -> None:
    s = SchedulerSide(KVLayerConfig(chunk_size=CHUNK, cpu_capacity=0, cache_salt="inst"), FakeLookups(16), BS)
    lookups = s._lookups
    running, waiting = request("run", 24, salt="t"), request("wait", 20)
    s.matched(running, 0)
    s.allocated(running, [1, 2, 3, 4, 5, 6], 0)
    s.build(output(new=[("run", [1, 2, 3, 4, 5, 6], 0)], scheduled={"run": 12}))  # computed KV: saved a chunk
    s.matched(waiting, 0)
    assert lookups.asked[-1][1] is None, "no salt given: the instance's, as the worker reads None"

    s.reset()
    assert s.matched(waiting, 0) == 16, "looked up again at once, under the new salt"
    salt = lookups.asked[-1][1]
    assert salt.startswith("inst\x1fkvlayer-reset:") and len(salt) > len("inst\x1fkvlayer-reset:")
    meta = s.build(output(cached=[("run", None, 12)], scheduled={"run": 12}))
    assert meta.reset and meta.saves == (), "its KV may be the old weights': the running request saves nothing"
    assert not s.build(output()).reset, "the workers are told once"

    fresh = request("new", 20, salt="t")
    s.matched(fresh, 0)
    assert lookups.asked[-1][1] == salt.replace("inst", "t"), "a later request: its own salt, the same tag"
    s.build(output(preempted=["run"]))  # vLLM restarts it: computed again, under the new weights
    resumed = s.build(output(cached=[("run", [7, 8, 9, 10, 11, 12], 0)], scheduled={"run": 24}, resumed=["run"]))
    (save,) = resumed.saves
    assert (save.first, save.salt, save.block_ids) == (0, salt.replace("inst", "t"), (7, 8, 9, 10, 11, 12))

    s.reset()
    s.matched(fresh, 0)
    assert lookups.asked[-1][1] != salt.replace("inst", "t"), "each reset a new tag: never an earlier one's chunks"
