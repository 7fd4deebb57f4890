"""The scheduler side of the vLLM connector, in vLLM's engine-core process (docs/vllm.md).

It holds no tiers: lookups go to the worker over the lookup channel (``vllm_lookup``). Per
request it keeps vLLM's ``Request`` (its tokens grow as it decodes), its block ids and how far
it has been saved; per step it turns vLLM's scheduler output into ``StepMetadata``: the loads
the last lookups granted and the chunks this step's tokens complete. Hits are whole vLLM
blocks and leave at least one prompt token to compute (vLLM's rule). Nothing here raises into
vLLM for a missing worker: that is a miss.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvlayer.config import KVLayerConfig
from kvlayer.connectors.vllm_lookup import Answer
from kvlayer.connectors.vllm_meta import LoadSpec, SaveSpec, StepMetadata


class Lookups(Protocol):
    """What the scheduler side asks the worker (``LookupClient``)."""

    def lookup(self, token_ids: Sequence[int], salt: str | None) -> Answer: ...


@dataclass(slots=True)
class _Tracked:
    request: Any  # vllm.v1.request.Request
    block_ids: list[int]
    saved_upto: int = 0
    matched: tuple[int, int] = (0, 0)
    sources: tuple[int, ...] = ()
    load: tuple[int, int] | None = None
    answer: tuple[int, float, Answer] | None = None
    """The last lookup: (token count, when, answer), reused while the request waits."""


REUSE_LOOKUP_S = 1.0
"""How long a waiting request's lookup is reused: vLLM asks again at every step until it can
admit the request, and the answer rarely changes within a second (a chunk evicted meanwhile
is a failed load, recomputed)."""


class SchedulerSide:
    """The connector's scheduler-side state for ``config`` with vLLM blocks of ``block_size``."""

    def __init__(self, config: KVLayerConfig, lookups: Lookups, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._lookups = lookups
        self._reqs: dict[str, _Tracked] = {}

    def matched(self, request: Any, num_computed: int) -> int:
        """How many tokens after vLLM's own ``num_computed`` kvlayer can load for ``request``:
        whole blocks, never the last prompt token. Repeatable (the last call counts); the
        worker is asked again only after ``REUSE_LOOKUP_S`` or an allocation."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Tracked(request, [])
        tokens = request.all_token_ids
        now = time.monotonic()
        if st.answer is not None and st.answer[0] == len(tokens) and now - st.answer[1] < REUSE_LOOKUP_S:
            found, sources = st.answer[2]
        else:
            found, sources = self._lookups.lookup(tokens, request.cache_salt)
            st.answer = (len(tokens), now, (found, sources))
        usable = min(found, len(tokens) - 1)
        usable -= usable % self.block_size
        st.matched, st.sources = (num_computed, usable), sources
        return max(0, usable - num_computed)

    def allocated(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM gave ``request`` its blocks, ``num_external`` of its tokens to come from kvlayer."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        st.block_ids = list(block_ids)
        st.answer = None
        if num_external > 0:
            start = st.matched[0]
            st.load = (start, start + num_external)

    def build(self, out: Any) -> StepMetadata:
        """This step's loads and saves from vLLM's ``SchedulerOutput`` ``out``."""
        for rid in out.finished_req_ids:
            self._reqs.pop(rid, None)
        for rid in out.preempted_req_ids or ():
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are gone; a resumed request is looked up again
                st.block_ids, st.load = [], None
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for rid, computed in self._scheduled(out):
            st = self._reqs.get(rid)
            if st is None:
                continue
            tokens = st.request.all_token_ids
            salt = st.request.cache_salt
            if st.load is not None:
                start, end = st.load
                st.load = None
                loads.append(LoadSpec(rid, salt, tuple(tokens[:end]), tuple(st.block_ids[: self._blocks(end)]),
                                      start, end, st.sources))
            limit = len(tokens) if self.config.save_decode_cache else st.request.num_prompt_tokens
            done = min(computed + out.num_scheduled_tokens.get(rid, 0), limit)
            due = done - done % self.config.chunk_size
            if due > st.saved_upto:
                saves.append(SaveSpec(rid, salt, tuple(tokens[:due]), tuple(st.block_ids[: self._blocks(due)]),
                                      st.saved_upto))
                st.saved_upto = due
        return StepMetadata(tuple(loads), tuple(saves))

    def _scheduled(self, out: Any) -> Iterable[tuple[str, int]]:
        """``(request id, computed tokens before this step)`` of every scheduled request, keeping
        each one's block ids current (new blocks appended; a resumed request's replaced)."""
        for new in out.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
            yield new.req_id, new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            added = cached.new_block_ids[i]
            if st is not None:
                if rid in resumed:
                    st.block_ids = list(added[0]) if added else []
                elif added:
                    st.block_ids += added[0]
            yield rid, cached.num_computed_tokens[i]

    def finished(self, request_id: str) -> None:
        """``request_id`` finished or was aborted: forget it."""
        self._reqs.pop(request_id, None)

    def load_failed(self, block_ids: set[int]) -> None:
        """The workers could not load ``block_ids``: vLLM recomputes them, and the chunks from the
        first of them on are saved again once recomputed."""
        for st in self._reqs.values():
            bad = next((i for i, b in enumerate(st.block_ids) if b in block_ids), None)
            if bad is not None:
                valid = bad * self.block_size
                st.saved_upto = min(st.saved_upto, valid - valid % self.config.chunk_size)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
