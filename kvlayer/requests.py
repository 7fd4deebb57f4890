"""The step layer's scheduler half: each request's progress (docs/architecture.md section 13).

``RequestTracker`` is what every adapter's scheduler side keeps per request: the one
window-aware lookup's answer (``Found``), the load it granted once the engine allocated blocks,
the request's block table, and how far it has been saved. Per step it turns each scheduled
request into at most one ``LoadSpec`` and one ``SaveSpec`` (``kvlayer.step``), applying the
rules every engine shares:

- a hit never covers the last prompt token (the engine needs its logits) and is a whole
  number of ``align`` tokens (vLLM's blocks; 1 for the bundled engine);
- a chunk is saved once, when the step computing its last token runs; with
  ``save_decode_cache`` off only the prompt's chunks are; a partial last chunk only with
  ``save_partial_chunks``;
- a chunk one of whose blocks a sliding window released (a negative block id) is skipped
  (``skipped_saves``); chunks a window-aware load covered are never saved again (their window
  layers' KV was not loaded);
- after a failed load, the chunks from the first invalid token on are saved again once
  recomputed (``load_failed``);
- a share ``verify_fraction`` of the requests with a hit are told it is a miss: the engine
  computes those tokens and their saves compare them with the stored chunks instead
  (``SaveSpec.verify_upto``, ``kvlayer.verify``);
- a load granted as an async load (``kvlayer.async_loads``) is handed out once, in the next
  step, to a request the engine keeps waiting for it (``take_async_loads``); the engine's
  allocation once it is loaded only replaces the block table;
- after ``reset`` (the engine dropped its cache: new weights) no chunk stored before is found
  again, and a request that computed KV before it saves nothing until the engine restarts it.

It holds no tiers and no keys: lookups go through ``lookup`` (in-process for the bundled
engine, over the lookup channel for vLLM). Use it from the engine's scheduler thread.
"""

from __future__ import annotations

import logging
import random
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvlayer.cache_groups import KVCacheGroups, released_before
from kvlayer.step import LoadSpec, SaveSpec
from kvlayer.windows import Found

log = logging.getLogger(__name__)

RESET_MARK = "\x1fkvlayer-reset:"
"""Joins a request's salt and the tag of the last ``RequestTracker.reset``."""

TrackerLookup = Callable[[str, Sequence[int], "str | None", int, int], Found]
"""(request id, token ids, salt, start, limit) -> the window-aware lookup's answer: a prefix of
at most ``limit`` tokens for a request holding ``start`` already (``KVCacheEngine.lookup``)."""


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """Which chunks of a request are saved (``KVLayerConfig``'s keys of the same names)."""

    chunk_size: int
    save_decode_cache: bool = False
    save_partial_chunks: bool = False
    windowed: bool = False
    """The tiers are window-aware (``KVLayout.windowed`` with ``window_aware`` on)."""


@dataclass(slots=True)
class _Request:
    token_ids: Sequence[int]
    num_prompt: int
    salt: str | None
    block_ids: list[int] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    """Every group's block table when the engine keeps several (``block_ids`` is the first's)."""
    saved_upto: int = 0
    start: int = 0
    found: Found = Found(0)
    load: tuple[int, int] | None = None
    complete_from: int = 0
    asked: tuple[int, int, float] | None = None
    """The last lookup's (token count, start, when), reused while the request waits."""
    sampled: bool | None = None
    """Whether the request's hit is verified instead of loaded (decided at its first hit)."""
    verify_upto: int = 0
    stale: bool = False
    """It computed KV before a ``reset``: it saves nothing until the engine restarts it."""


class RequestTracker:
    """Every live request's progress; see the module docstring.

    ``lookup`` answers ``matched``; ``block_size`` is the engine's; ``align`` the granularity of a
    hit (vLLM's: its block size); ``reuse_s``: how long a
    waiting request's lookup answer is reused when asked again for the same tokens (vLLM asks
    at every step until it admits the request; 0: always ask); ``verify_fraction``: the share of
    requests with a hit whose hit is verified instead of loaded (``KVLayerConfig.verify_fraction``).
    ``groups``: an engine's KV-cache groups (vLLM's hybrid manager). With several, the
    block-table calls take every group's table (``groups``) and the specs carry them
    (``LoadSpec.groups``); where a group's window slides, the engine releases the blocks before
    it as a request runs (``released_before``, from each ``step`` on). A negative block id is a
    block a sliding window released (vLLM's null block) in any table.
    """

    def __init__(self, lookup: TrackerLookup, policy: SavePolicy, block_size: int, align: int = 1,
                 reuse_s: float = 0.0, verify_fraction: float = 0.0, groups: KVCacheGroups | None = None) -> None:
        self._lookup = lookup
        self._layer_groups = groups.grouped if groups is not None else ()
        self._windows = groups.group_windows if groups is not None and groups.layer_windows else ()
        self._verify_fraction = verify_fraction
        self._random = random.Random()
        self.policy = policy
        self._block_size = block_size
        self._align = max(1, align)
        self._reuse_s = reuse_s
        self._reqs: dict[str, _Request] = {}
        self._async: dict[str, int] = {}  # async loads granted, for the next step: request -> start
        self._loading: set[str] = set()  # async loads handed out, the request not scheduled since
        self.skipped_saves = 0
        """Chunks not saved because a sliding window released one of their blocks."""
        self.async_loads = 0
        """Loads handed out as async loads (``take_async_loads``)."""
        self._reset: tuple[str, str] | None = None  # (the last reset's tag, the salt None stands for)

    def __len__(self) -> int:
        return len(self._reqs)

    def _get(self, rid: str, token_ids: Sequence[int], num_prompt: int, salt: str | None) -> _Request:
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Request(token_ids, num_prompt, self._salted(salt))
        st.token_ids = token_ids
        return st

    def reset(self, instance_salt: str = "") -> None:
        """The engine dropped its cache (vLLM's ``reset_prefix_cache``, as after a weight update):
        from now on every request's salt is joined with a new random tag (``instance_salt``
        standing for a request's None), so no chunk stored before, here or by another instance
        sharing the tiers, is found again, nor one of another reset. Live requests are looked up
        again under it; one that computed KV before saves nothing until ``preempted`` (its KV may
        come from the old weights), and a load granted to it misses (the engine recomputes)."""
        self._reset = (secrets.token_hex(8), instance_salt)
        for st in self._reqs.values():
            st.salt, st.found, st.asked = self._salted(st.salt), Found(0), None
            if st.block_ids or st.saved_upto or st.start:
                st.stale, st.saved_upto = True, sys.maxsize

    def _salted(self, salt: str | None) -> str | None:
        if self._reset is None:
            return salt
        tag, instance_salt = self._reset
        base = instance_salt if salt is None else salt.split(RESET_MARK, 1)[0]
        return f"{base}{RESET_MARK}{tag}"

    # ----- admission ----------------------------------------------------------------------
    def matched(self, rid: str, token_ids: Sequence[int], num_prompt: int, salt: str | None,
                num_computed: int) -> int:
        """How many tokens after the engine's own ``num_computed`` kvlayer can load (>= 0).
        Repeatable: the last call counts."""
        st = self._get(rid, token_ids, num_prompt, salt)
        self._loading.discard(rid)  # looked up again: its async load failed from its first block
        limit = len(token_ids) - 1
        limit -= limit % self._align
        now = time.monotonic()
        asked = (len(token_ids), num_computed)
        if st.asked is None or st.asked[:2] != asked or now - st.asked[2] >= self._reuse_s:
            st.found = self._lookup(rid, token_ids, st.salt, num_computed, limit) if limit > num_computed else Found(0)
            st.asked = (*asked, now)
        st.start = num_computed
        hit = max(0, min(st.found.num_tokens, limit) - num_computed)
        if hit and st.sampled is None:
            st.sampled = self._random.random() < self._verify_fraction
        if hit and st.sampled:
            st.verify_upto = max(st.verify_upto, num_computed + hit)
            return 0
        return hit

    def allocated(self, rid: str, block_ids: Sequence[int] | None, num_external: int,
                  groups: Sequence[Sequence[int]] = (), async_load: bool = False) -> None:
        """The engine allocated the request's blocks (its whole table, if given; every group's in
        ``groups`` with several KV-cache groups), ``num_external`` of its tokens after
        ``num_computed`` to come from kvlayer, asynchronously with ``async_load`` (the engine keeps
        the request waiting until the load is reported). For a request whose async load was handed
        out, the allocation once it is loaded: only its block table changes."""
        st = self._reqs.get(rid)
        if st is None:
            return
        if block_ids is not None:
            _set_tables(st, block_ids, groups)
        if rid in self._loading:
            return
        st.asked = None
        st.complete_from = 0
        if num_external > 0:
            st.load = (st.start, st.start + num_external)
            st.complete_from = max(st.start, st.found.all_layers_from)
            if self.policy.windowed:
                end = st.load[1]
                st.saved_upto = max(st.saved_upto, end - end % self.policy.chunk_size)
            if async_load:
                self._async[rid] = st.start

    def complete_from(self, rid: str) -> int:
        """The first position from which the granted load holds every layer's KV (0: no load)."""
        st = self._reqs.get(rid)
        return 0 if st is None else st.complete_from

    def found(self, rid: str) -> Found:
        """The request's last lookup's answer (``Found(0)`` for a request not tracked)."""
        st = self._reqs.get(rid)
        return st.found if st is not None else Found(0)

    # ----- the request as it runs ---------------------------------------------------------
    def update(self, rid: str, token_ids: Sequence[int], num_prompt: int, salt: str | None,
               block_ids: Sequence[int] | None = None) -> None:
        """The request's tokens now (prompt and generated) and, if given, its whole block table;
        starts tracking a request never looked up."""
        st = self._get(rid, token_ids, num_prompt, salt)
        if block_ids is not None:
            st.block_ids = list(block_ids)

    def set_blocks(self, rid: str, block_ids: Sequence[int], groups: Sequence[Sequence[int]] = ()) -> None:
        """The request's whole block table now (a resumed request's new one); every group's in
        ``groups`` with ``layer_groups`` (``block_ids`` the first's)."""
        st = self._reqs.get(rid)
        if st is not None:
            _set_tables(st, block_ids, groups)

    def add_blocks(self, rid: str, block_ids: Iterable[int], groups: Sequence[Sequence[int]] = ()) -> None:
        """Blocks appended to the request's table (to each group's, from ``groups``, as for ``set_blocks``)."""
        st = self._reqs.get(rid)
        if st is None:
            return
        if not st.groups:
            st.block_ids.extend(block_ids)
        for table, added in zip(st.groups, groups):  # block_ids is the first group's table
            table.extend(added)

    def released(self, rid: str, before: Sequence[int]) -> None:
        """The engine released the blocks of each table (each group's, or the one) that lie
        wholly before token ``before[i]`` (a sliding window's); they then read as released."""
        st = self._reqs.get(rid)
        if st is None:
            return
        for table, upto in zip(st.groups or [st.block_ids], before):
            for i in range(min(upto // self._block_size, len(table))):
                table[i] = -1

    def preempted(self, rid: str) -> None:
        """The engine took the request's blocks back: its granted load is void (a resumed
        request is looked up again)."""
        st = self._reqs.get(rid)
        if st is not None:
            st.block_ids, st.groups, st.load = [], [], None
            if st.stale:  # computed again from the start, under the new weights
                st.stale, st.saved_upto = False, 0

    # ----- one step -----------------------------------------------------------------------
    def step(self, rid: str, num_computed: int, num_scheduled: int) -> tuple[LoadSpec | None, SaveSpec | None]:
        """The request's load (once, in the step after its allocation) and its saves for a step
        that schedules it, computing tokens ``[num_computed, num_computed + num_scheduled)``;
        (None, None) for a request not tracked. An async load not handed out yet is then a
        synchronous one (the engine scheduled the request at once)."""
        self._async.pop(rid, None)
        self._loading.discard(rid)
        if self._windows:  # the blocks a sliding window released before this step
            self.released(rid, released_before(self._windows, num_computed))
        return self._step(rid, num_computed, num_scheduled)

    def take_async_loads(self) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """The async loads granted since the last call to requests this step does not schedule
        (call after ``step`` for those it does), each handed out once, and those requests' saves."""
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for rid, start in self._async.items():
            load, save = self._step(rid, start, 0)
            if load is not None:
                loads.append(load)
                self._loading.add(rid)
            saves += [save] if save is not None else []
        self._async = {}
        self.async_loads += len(loads)
        return loads, saves

    def _step(self, rid: str, num_computed: int, num_scheduled: int) -> tuple[LoadSpec | None, SaveSpec | None]:
        st = self._reqs.get(rid)
        if st is None:
            return None, None
        tokens = st.token_ids
        load = None
        if st.load is not None:
            start, end = st.load
            st.load = None
            covered = min(len(tokens), -(-end // self.policy.chunk_size) * self.policy.chunk_size)
            load = LoadSpec(rid, st.salt, tuple(tokens[:covered]), tuple(st.block_ids[: self._blocks(end)]), start,
                            end, st.found.sources, *self._tables(st, end))
        return load, self._save(rid, st, num_computed + num_scheduled)

    def _save(self, rid: str, st: _Request, done: int) -> SaveSpec | None:
        policy = self.policy
        limit = len(st.token_ids) if policy.save_decode_cache else st.num_prompt
        ends = [e for e in _chunk_ends(min(done, limit), limit, policy) if e > st.saved_upto]
        if not ends:
            return None
        tables = st.groups or [st.block_ids]
        held = [e for e in ends if all(self._holds(t, e - _chunk_len(e, policy), e) for t in tables)]
        first = st.saved_upto
        if len(held) < len(ends):
            skipped = len(ends) - len(held)
            if not self.skipped_saves:
                log.info("kvlayer: chunks whose blocks a sliding window released are not saved")
            self.skipped_saves += skipped
            # a window releases leading blocks: save the held chunks after the last skipped one
            last_gap = max(e for e in ends if e not in held)
            held = [e for e in held if e > last_gap]
            first = last_gap
        st.saved_upto = ends[-1]
        if not held:
            return None
        due = held[-1]
        return SaveSpec(rid, st.salt, tuple(st.token_ids[:due]), tuple(st.block_ids[: self._blocks(due)]), first,
                        st.verify_upto, *self._tables(st, due))

    def _tables(self, st: _Request, end: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """``(groups, layer_groups)`` of a spec over tokens ``0..end-1``: every group's table, or () for one."""
        if not self._layer_groups or not st.groups:
            return (), ()
        return tuple(tuple(t[: self._blocks(end)]) for t in st.groups), self._layer_groups

    def _holds(self, block_ids: Sequence[int], start: int, end: int) -> bool:
        """Whether every block of tokens ``[start, end)`` is allocated and held."""
        blocks = block_ids[start // self._block_size : self._blocks(end)]
        return len(blocks) == self._blocks(end) - start // self._block_size and min(blocks, default=0) >= 0

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self._block_size)

    # ----- outcomes -----------------------------------------------------------------------
    def load_failed(self, rid: str, valid: int) -> None:
        """The request's load left only ``valid`` leading tokens: the chunks from there on are
        saved again once recomputed."""
        st = self._reqs.get(rid)
        if st is not None:
            valid = min(st.saved_upto, valid)
            st.saved_upto = valid - valid % self.policy.chunk_size

    def blocks_failed(self, block_ids: set[int]) -> None:
        """``load_failed`` for every request holding one of ``block_ids`` (vLLM reports blocks)."""
        for rid, st in self._reqs.items():
            bad = next((i for i, b in enumerate(st.block_ids) if b in block_ids), None)
            if bad is not None:
                self.load_failed(rid, bad * self._block_size)

    def finished(self, rid: str) -> None:
        """The request finished or was aborted: forget it (an async load of its own still running
        is the worker's to finish)."""
        self._reqs.pop(rid, None)
        self._async.pop(rid, None)
        self._loading.discard(rid)


def _set_tables(st: _Request, block_ids: Sequence[int], groups: Sequence[Sequence[int]]) -> None:
    """``st``'s block tables now: every group's (``block_ids`` then the first's, kept as one list), or one."""
    st.groups = [list(g) for g in groups]
    st.block_ids = st.groups[0] if st.groups else list(block_ids)


def _chunk_ends(done: int, limit: int, policy: SavePolicy) -> list[int]:
    """The ends of the chunks of tokens ``[0, limit)`` that lie within ``[0, done)``."""
    c = policy.chunk_size
    ends = list(range(c, done + 1, c))
    if policy.save_partial_chunks and done == limit and limit % c:
        ends.append(limit)
    return ends


def _chunk_len(end: int, policy: SavePolicy) -> int:
    """Tokens of the chunk ending at ``end`` (a partial last chunk is shorter)."""
    return end % policy.chunk_size or policy.chunk_size
