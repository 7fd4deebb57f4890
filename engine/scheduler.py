"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step spends at most ``max_num_batched_tokens`` tokens: running sequences first (their
decode token, or the next piece of an unfinished prefill), then waiting sequences first come
first served while ``max_num_seqs`` and the free blocks allow. When a running sequence needs
a block and none is free, the most recently arrived running sequence is preempted: its
blocks are freed and it is recomputed later from its tokens so far.

With ``attention_reach`` (a model whose every layer slides, ``ModelConfig.attention_reach``) a
running sequence first gives back its blocks no window reaches from its next query on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvlayer.connectors.base import KVConnectorBase
from kvlayer.engine.block_manager import BlockManager
from kvlayer.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """``num_new`` tokens of ``seq`` computed this step, from ``seq.num_computed_tokens``."""

    seq: Sequence
    num_new: int

    @property
    def samples(self) -> bool:
        """Whether this step completes the sequence's known tokens (so it yields a token)."""
        return self.seq.num_computed_tokens + self.num_new == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: single-token pieces first (decodes), then multi-token prefill pieces."""

    decodes: tuple[ScheduledSeq, ...]
    prefills: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def all(self) -> tuple[ScheduledSeq, ...]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.all)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Decides which tokens of which sequences each step computes."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: KVConnectorBase | None = None, attention_reach: int | None = None) -> None:
        self.bm = block_manager
        self.attention_reach = attention_reach
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        picked: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.attention_reach is not None:  # the next query, at num_computed, sees back to here
                self.bm.release_before(seq, seq.num_computed_tokens - self.attention_reach + 1)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            picked.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            self.running.append(item.seq)
            picked.append(item)
            budget -= item.num_new
        decodes = tuple(p for p in picked if p.num_new == 1)
        prefills = tuple(p for p in picked if p.num_new > 1)
        return StepPlan(decodes, prefills, tuple(preempted))

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Take blocks for a waiting sequence's cached prefix and next tokens, or None."""
        hits = self.bm.match_prefix(seq)
        num_local = len(hits) * self.bm.block_size
        num_external = 0
        if self.connector is not None:
            num_external = self.connector.get_num_new_matched_tokens(seq, num_local)
            num_external = max(0, min(num_external, seq.num_tokens - 1 - num_local))
        start = num_local + num_external
        n = min(seq.num_tokens - start, budget)
        new_blocks = self.bm.blocks_needed(start + n) - len(hits)
        if not self.bm.can_allocate(hits, new_blocks):
            return None
        self.bm.take_hits(seq, hits)
        ok = self.bm.grow(seq, start + n)
        assert ok, "can_allocate promised room"
        if self.connector is not None:
            self.connector.update_state_after_alloc(seq, tuple(seq.block_table), num_external)
        has_load = self.connector is not None and num_external > 0
        seq.partial_kv_before = self.connector.get_kv_complete_from(seq) if has_load else 0
        seq.num_computed_tokens = start
        seq.num_cached_tokens = num_local
        seq.num_external_tokens = num_external
        seq.status = SequenceStatus.RUNNING
        if seq.times.first_scheduled_time is None:
            seq.times.first_scheduled_time = time.perf_counter()
        return ScheduledSeq(seq, n)

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def find(self, request_id: str) -> Sequence | None:
        """The unfinished sequence of ``request_id`` (waiting or running), or None."""
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (running or waiting: an abort may take either); its blocks are
        freed by the caller (maybe after a save)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finish_time = time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
