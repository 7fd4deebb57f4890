"""The scheduler side of the vLLM connector, in vLLM's engine-core process (docs/vllm.md).

A translation of vLLM's scheduler hooks into the step layer's ``RequestTracker``
(``kvlayer.requests``): it holds no tiers, and its lookups go to the worker over the lookup
channel (``lookup_channel``), asked again at most every ``REUSE_LOOKUP_S`` while vLLM keeps a
request waiting. Hits are whole vLLM blocks and leave at least one prompt token to compute
(vLLM's rule). Per step it keeps each request's block table as vLLM's ``SchedulerOutput``
reports it and returns the tracker's ``StepSpec``. A missing worker is a miss, never an error.
With ``async_loads`` on, a hit with a chunk from a tier below memory
(``kvlayer.async_loads.lower_tiers``) loads asynchronously: vLLM keeps the request waiting, the
step after its allocation carries the load in ``StepSpec.async_loads``, and the request is
scheduled once the workers report it loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvlayer.async_loads import below_memory, lower_tiers
from kvlayer.cache_groups import KVCacheGroups
from kvlayer.config import KVLayerConfig
from kvlayer.connectors.lookup_channel import MISS, Answer
from kvlayer.connectors.vllm_groups import block_tables
from kvlayer.requests import RequestTracker, SavePolicy
from kvlayer.step import LoadSpec, SaveSpec, StepSpec
from kvlayer.windows import Found

REUSE_LOOKUP_S = 1.0
"""How long a waiting request's lookup is reused: vLLM asks again at every step until it can
admit the request, and the answer rarely changes within a second (a chunk evicted meanwhile
is a failed load, recomputed)."""


class Lookups(Protocol):
    """What the scheduler side asks the worker (``LookupClient``)."""

    def lookup(self, token_ids: Sequence[int], salt: str | None, *, request_id: str = "", start: int = 0,
               limit: int | None = None) -> Answer: ...


class RankLookups(Protocol):
    """One rank's lookups in two halves (``LookupClient``): every rank is asked, then answers."""

    def send(self, token_ids: Sequence[int], salt: str | None, *, request_id: str = "", start: int = 0,
             limit: int | None = None) -> bool: ...

    def receive(self, asked: int) -> Answer: ...


class RankedLookups:
    """The lookups of every tensor-parallel rank's worker (rank order), asked at once and then
    read, so a lookup takes the slowest rank's time, not their sum. A chunk counts as held only
    when every rank holds its shard, so the answer is the fewest tokens any rank found. The
    tiers of each chunk object go with it when every rank answered the same; otherwise none
    (each worker then asks its own tiers again at load time, and a shard gone by then is a
    failed load that vLLM recomputes)."""

    def __init__(self, ranks: Sequence[RankLookups]) -> None:
        if not ranks:
            raise ValueError("RankedLookups needs at least one rank")
        self._ranks = list(ranks)

    def lookup(self, token_ids: Sequence[int], salt: str | None, *, request_id: str = "", start: int = 0,
               limit: int | None = None) -> Answer:
        sent = [r.send(token_ids, salt, request_id=request_id, start=start, limit=limit) for r in self._ranks]
        answers = [r.receive(len(token_ids)) if ok else MISS for r, ok in zip(self._ranks, sent, strict=True)]
        if all(a == answers[0] for a in answers):
            return answers[0]
        found = min(a[0] for a in answers)
        return (found, ()) if found else MISS


class SchedulerSide:
    """The connector's scheduler-side state for ``config`` with vLLM blocks of ``block_size``;
    ``groups``: vLLM's KV-cache groups (several under its hybrid manager; None: one)."""

    def __init__(self, config: KVLayerConfig, lookups: Lookups, block_size: int,
                 groups: KVCacheGroups | None = None) -> None:
        self.config = config
        self._lookups = lookups
        policy = SavePolicy(config.chunk_size, config.save_decode_cache, config.save_partial_chunks)
        self._tracker = RequestTracker(self._ask, policy, block_size, align=block_size, reuse_s=REUSE_LOOKUP_S,
                                       verify_fraction=config.verify_fraction, groups=groups)
        self._lower = lower_tiers(config) if config.async_loads else None
        # vLLM takes a failed load of several KV-cache groups only per request, of an async load
        self._every_async = groups is not None and groups.num_groups > 1
        self._reset = False

    @property
    def async_loads(self) -> int:
        """Loads handed to the workers as async loads."""
        return self._tracker.async_loads

    def _ask(self, rid: str, token_ids: Sequence[int], salt: str | None, start: int, limit: int) -> Found:
        found, sources = self._lookups.lookup(token_ids, salt, request_id=rid, start=start, limit=limit)
        return Found(found, (), tuple(sources), start)

    def matched(self, request: Any, num_computed: int) -> int:
        """How many tokens after vLLM's own ``num_computed`` kvlayer can load for ``request``."""
        return self._tracker.matched(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                                     request.cache_salt, num_computed)

    def loads_async(self, request_id: str) -> bool:
        """Whether the hit ``matched`` last found for ``request_id`` loads asynchronously: with
        ``async_loads`` on, when one of its chunks comes from a tier below memory, or the ranks
        disagreed on the tiers (each worker then looks again, maybe below memory)."""
        if self._every_async:
            return True
        return self._lower is not None and below_memory(self._tracker.found(request_id).sources, self._lower)

    def allocated(self, request: Any, block_ids: Sequence[int], num_external: int,
                  groups: Sequence[Sequence[int]] = ()) -> None:
        """vLLM gave ``request`` its blocks, ``num_external`` of its tokens to come from kvlayer
        (asynchronously where ``loads_async`` says so); ``groups``: vLLM's block ids per KV-cache
        group (``block_ids`` the first's). vLLM calls it again for a request whose async load is
        done, with more blocks and nothing to load."""
        rid = request.request_id
        ids, tables = block_tables(block_ids, groups)
        self._tracker.allocated(rid, ids, num_external, tables, num_external > 0 and self.loads_async(rid))

    def build(self, out: Any) -> StepSpec:
        """This step's loads and saves from vLLM's ``SchedulerOutput`` ``out``."""
        for rid in out.finished_req_ids:
            self._tracker.finished(rid)
        for rid in out.preempted_req_ids or ():
            self._tracker.preempted(rid)
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for rid, computed in self._scheduled(out):
            load, save = self._tracker.step(rid, computed, out.num_scheduled_tokens.get(rid, 0))
            loads += [load] if load is not None else []
            saves += [save] if save is not None else []
        waiting, more = self._tracker.take_async_loads()  # not scheduled: vLLM waits for their KV
        reset, self._reset = self._reset, False
        return StepSpec(tuple(loads), tuple(saves + more), tuple(waiting), reset)

    def _scheduled(self, out: Any) -> Iterable[tuple[str, int]]:
        """``(request id, computed tokens before this step)`` of every scheduled request, keeping
        each one's block ids current (new blocks appended; a resumed request's replaced)."""
        for new in out.scheduled_new_reqs:
            self._tracker.set_blocks(new.req_id, *block_tables(new.block_ids[0], new.block_ids))
            yield new.req_id, new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]  # per KV-cache group, or None
            if rid in resumed:
                self._tracker.set_blocks(rid, *block_tables(added[0], added) if added else ([], []))
            elif added:
                self._tracker.add_blocks(rid, *block_tables(added[0], added))
            yield rid, cached.num_computed_tokens[i]

    def reset(self) -> None:
        """vLLM reset its prefix cache: no chunk stored before is found again
        (``RequestTracker.reset``), and the next step empties the workers' CPU tiers."""
        self._tracker.reset(self.config.cache_salt)
        self._reset = True

    def finished(self, request_id: str) -> None:
        """``request_id`` finished or was aborted: forget it (an async load of its own still
        running is the workers' to finish; vLLM frees its blocks once they report it)."""
        self._tracker.finished(request_id)

    def load_failed(self, block_ids: set[int]) -> None:
        """The workers could not load ``block_ids``: vLLM recomputes them, and the chunks from the
        first of them on are saved again once recomputed."""
        self._tracker.blocks_failed(block_ids)
