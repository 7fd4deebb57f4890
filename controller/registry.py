"""The controller's registry: which instance holds which chunks, per tier (never any KV data).

An instance's entry is created when it registers (empty, state SYNCING), filled by its
snapshot (then UP) and kept current by its admission and eviction events. A tier with a
``shared_id`` (the same Redis, say, seen by several instances) is one pool of digests shared by
every instance attached to it: any attached instance's admissions and evictions update it, and
it is dropped when the last of them goes down; a pool one of them *hosts* (a node cache
server's arena: ``hosted``) is emptied when the last of its hosts goes down. ``mark_down``
empties an instance's tiers; the entry stays, DOWN, until it registers again or is forgotten.

Pure Python and single-threaded: the server calls it from its event loop only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvlayer.keys import ChunkKey, Namespace, chunk_keys
from kvlayer.layout import KVLayout
from kvlayer.tier_manager import LookupResult
from kvlayer.windows import find_prefix

Clock = Callable[[], float]


class State(enum.Enum):
    """An instance's lifecycle: registered (SYNCING), snapshot complete (UP), gone (DOWN)."""
    SYNCING = "syncing"
    UP = "up"
    DOWN = "down"


class RegistryFull(Exception):
    """An instance or a tier would exceed the registry's bounds."""


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A tier as an instance registers it; ``shared_id`` non-empty for a store other instances see too;
    ``cannot_pin`` for a store that evicts by its own policy (Redis); ``hosted`` for a shared store
    that lives in this instance's process (its chunks go with the last such instance)."""

    name: str
    rank: int
    in_memory: bool
    shared_id: str = ""
    cannot_pin: bool = False
    hosted: bool = False


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What an instance registers: how its keys are computed, which tiers it has (top first), its
    ``role`` in prefill/decode disaggregation (one of ``kvlayer.config.INSTANCE_ROLES``) and the
    name clients ask for its model by (``served_model``; "": the namespace's model name only)."""

    instance_id: str
    address: str
    namespace: Namespace
    save_partial_chunks: bool
    tiers: tuple[TierSpec, ...]
    role: str = "both"
    served_model: str = ""

    def model_names(self) -> tuple[str, ...]:
        """The names its model is known by: the namespace's, then the served name if it differs."""
        name = self.namespace.model_name
        return (name, self.served_model) if self.served_model and self.served_model != name else (name,)

    def tier(self, name: str) -> TierSpec | None:
        """The tier called ``name``, None if the instance has none."""
        return next((t for t in self.tiers if t.name == name), None)

    def pinnable(self) -> list[str]:
        """The names of the tiers that can pin, top first."""
        return [t.name for t in self.tiers if not t.cannot_pin]

    def keys(self, token_ids: Sequence[int], salt: str | None) -> list[ChunkKey]:
        """The chunk keys this instance computes for ``token_ids`` (``salt`` None: its default)."""
        return chunk_keys(self.namespace.with_salt(salt), token_ids, self.save_partial_chunks)


@dataclass(slots=True)
class Instance:
    """An instance's registry entry; ``stats`` is its last heartbeat's per-tier counters."""

    spec: InstanceSpec
    state: State
    last_seen: float
    held: dict[str, set[bytes]] = field(default_factory=dict)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    down_since: float | None = None

    @property
    def instance_id(self) -> str:
        """The registered id."""
        return self.spec.instance_id


@dataclass(frozen=True, slots=True)
class Match:
    """How much of a key sequence an instance holds: ``cached_tokens`` in its tiers together,
    ``local_tokens`` in its own (unshared) tiers together, and per tier the leading tokens that
    tier holds by itself (every tier listed); ``role`` is the instance's registered role."""

    instance_id: str
    address: str
    cached_tokens: int
    per_tier: dict[str, int]
    local_tokens: int = 0
    role: str = "both"

    def rank(self) -> tuple[int, int, str]:
        """Sort key, best first: most cached tokens, then most held locally, then the lowest id."""
        return -self.cached_tokens, -self.local_tokens, self.instance_id


@dataclass(slots=True)
class _Pool:
    digests: set[bytes] = field(default_factory=set)
    members: set[str] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)


class Registry:
    """Instances and the chunk digests of their tiers; bounded by ``max_instances`` and
    ``max_chunks_per_tier`` (``RegistryFull`` beyond them)."""

    def __init__(self, max_instances: int = 1024, max_chunks_per_tier: int = 4_000_000,
                 clock: Clock = time.monotonic) -> None:
        self._instances: dict[str, Instance] = {}
        self._pools: dict[str, _Pool] = {}
        self._max_instances = max_instances
        self._max_chunks = max_chunks_per_tier
        self._clock = clock

    # --- lifecycle ----------------------------------------------------------------------
    def register(self, spec: InstanceSpec) -> Instance:
        """A fresh, empty entry for ``spec`` (replacing any earlier one of the same id)."""
        old = self._instances.get(spec.instance_id)
        if old is None and len(self._instances) >= self._max_instances:
            self.forget_down(0.0)
            if len(self._instances) >= self._max_instances:
                raise RegistryFull(f"the registry holds its maximum of {self._max_instances} instances")
        if old is not None:
            self._detach(old)
        entry = Instance(spec, State.SYNCING, self._clock())
        for tier in spec.tiers:
            if tier.shared_id:
                pool = self._pools.setdefault(tier.shared_id, _Pool())
                pool.members.add(spec.instance_id)
                if tier.hosted:
                    pool.hosts.add(spec.instance_id)
            else:
                entry.held[tier.name] = set()
        self._instances[spec.instance_id] = entry
        return entry

    def mark_synced(self, entry: Instance) -> None:
        """The snapshot is complete: ``entry`` is UP (no-op if it was replaced)."""
        if self.current(entry):
            entry.state = State.UP

    def mark_down(self, entry: Instance) -> None:
        """Drop what ``entry`` holds and mark it DOWN (no-op if it was replaced meanwhile)."""
        if not self.current(entry) or entry.state is State.DOWN:
            return
        self._detach(entry)
        entry.state = State.DOWN
        entry.down_since = self._clock()
        entry.held = {}
        entry.stats = {}

    def forget_down(self, older_than_s: float) -> list[str]:
        """Remove entries DOWN for longer than ``older_than_s``; returns their ids."""
        now = self._clock()
        gone = [i for i, e in self._instances.items()
                if e.state is State.DOWN and e.down_since is not None and now - e.down_since >= older_than_s]
        for instance_id in gone:
            del self._instances[instance_id]
        return gone

    def touch(self, entry: Instance) -> None:
        """``entry`` sent a message now."""
        entry.last_seen = self._clock()

    def expired(self, timeout_s: float) -> list[Instance]:
        """Live entries whose last message is older than ``timeout_s``."""
        now = self._clock()
        return [e for e in self._instances.values() if e.state is not State.DOWN and now - e.last_seen > timeout_s]

    def seen_ago(self, entry: Instance) -> float:
        """Seconds since ``entry``'s last message."""
        return max(0.0, self._clock() - entry.last_seen)

    def current(self, entry: Instance) -> bool:
        """Whether ``entry`` is still the registered entry of its id."""
        return self._instances.get(entry.instance_id) is entry

    # --- chunks -------------------------------------------------------------------------
    def admit(self, entry: Instance, tier: str, digests: Iterable[bytes]) -> None:
        """Record ``digests`` in ``entry``'s ``tier``; KeyError for a tier it did not register."""
        target = self._target(entry, tier)
        if target is None:
            return
        target.update(digests)
        if len(target) > self._max_chunks:
            raise RegistryFull(f"tier {tier!r} of {entry.instance_id!r} exceeds {self._max_chunks} chunks")

    def evict(self, entry: Instance, tier: str, digests: Iterable[bytes]) -> None:
        """Forget ``digests`` in ``entry``'s ``tier``; KeyError for a tier it did not register."""
        target = self._target(entry, tier)
        if target is not None:
            target.difference_update(digests)

    def set_stats(self, entry: Instance, stats: dict[str, dict[str, int]]) -> None:
        """Keep ``entry``'s last heartbeat counters (per tier name)."""
        entry.stats = stats

    # --- queries ------------------------------------------------------------------------
    def get(self, instance_id: str) -> Instance | None:
        """The entry of ``instance_id``, None if unknown."""
        return self._instances.get(instance_id)

    def instances(self) -> list[Instance]:
        """Every entry (DOWN ones included), by id."""
        return [self._instances[i] for i in sorted(self._instances)]

    def live(self, model: str | None = None) -> list[Instance]:
        """Entries not DOWN (of ``model``, by its namespace name or served name, if given), by id."""
        return [e for e in self.instances()
                if e.state is not State.DOWN and (model is None or model in e.spec.model_names())]

    def chunk_count(self, entry: Instance, tier: str) -> int:
        """How many chunks ``entry``'s ``tier`` holds (0 for DOWN entries and unknown tiers)."""
        target = self._holding(entry, tier)
        return len(target) if target is not None else 0

    def match(self, entry: Instance, keys: Sequence[ChunkKey]) -> Match:
        """How many tokens of the prefix ``keys`` (chunks of every layer, from token 0) ``entry``
        could load, in its tiers together and per tier: the engine's own window-aware lookup
        (``kvlayer.windows.find_prefix``) over the digests the entry holds."""
        layout = entry.spec.namespace.layout
        sets = [(t, self._holding(entry, t.name) or set()) for t in entry.spec.tiers]
        per_tier = {t.name: _loadable(layout, keys, [held]) for t, held in sets}
        together = _loadable(layout, keys, [held for _, held in sets])
        local = _loadable(layout, keys, [held for t, held in sets if not t.shared_id])
        return Match(entry.instance_id, entry.spec.address, together, per_tier, local, entry.spec.role)

    # --- internals ----------------------------------------------------------------------
    def _holding(self, entry: Instance, tier: str) -> set[bytes] | None:
        spec = entry.spec.tier(tier)
        if spec is None or entry.state is State.DOWN:
            return None
        if spec.shared_id:
            pool = self._pools.get(spec.shared_id)
            return pool.digests if pool is not None else None
        return entry.held.get(tier)

    def _target(self, entry: Instance, tier: str) -> set[bytes] | None:
        """Where ``tier``'s changes go; None for a replaced or DOWN entry; KeyError for an unknown tier."""
        if entry.spec.tier(tier) is None:
            raise KeyError(f"instance {entry.instance_id!r} has no tier {tier!r}")
        if not self.current(entry):
            return None
        return self._holding(entry, tier)

    def _detach(self, entry: Instance) -> None:
        for tier in entry.spec.tiers:
            pool = self._pools.get(tier.shared_id) if tier.shared_id else None
            if pool is not None:
                pool.members.discard(entry.instance_id)
                if tier.hosted and entry.instance_id in pool.hosts:
                    pool.hosts.discard(entry.instance_id)
                    if not pool.hosts:  # the process that held these chunks is gone
                        pool.digests.clear()
                if not pool.members:
                    del self._pools[tier.shared_id]


class _Held:
    """Digest sets as the tiers ``find_prefix`` asks (top first): a lookup answers the leading
    keys some set holds, each sourced from the first set that holds it."""

    def __init__(self, held: Sequence[set[bytes]]) -> None:
        self._held = held

    def lookup(self, keys: Sequence[ChunkKey], record: bool = True) -> LookupResult:
        sources: list[int] = []
        for key in keys:
            where = next((i for i, h in enumerate(self._held) if key.digest in h), None)
            if where is None:
                break
            sources.append(where)
        n = len(sources)
        return LookupResult(n, keys[n - 1].end if n else 0, {}, tuple(sources))

    def lookup_many(self, requests: Sequence[Sequence[ChunkKey]], record: bool = True) -> list[LookupResult]:
        return [self.lookup(keys) for keys in requests]


def _loadable(layout: KVLayout, keys: Sequence[ChunkKey], held: Sequence[set[bytes]]) -> int:
    """The tokens of the prefix ``keys`` a load from the ``held`` sets would give."""
    if not keys or not any(held):
        return 0
    return find_prefix(_Held(held), layout, keys, 0, keys[-1].end).num_tokens  # type: ignore[arg-type]
