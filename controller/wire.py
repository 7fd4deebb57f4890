"""Checked conversions between the wire (``controller.proto``) and kvlayer's own types.

Everything an instance or an admin sends passes through here: a malformed value raises
``RequestError`` (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for what is too big) naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvlayer.config import INSTANCE_ROLES
from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.errors import exhausted, invalid
from kvlayer.controller.registry import InstanceSpec, TierSpec
from kvlayer.keys import KEY_BYTES, Namespace
from kvlayer.layout import DEFAULT_CACHE_LAYOUT, KVLayout, dtype_name, parse_dtype

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
"""Instance ids and tier names: printable, no spaces, at most 128 characters."""
TIER_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
CACHE_SERVER_ROLE = "cache-server"
"""The role a node cache server's registrations carry (it serves no requests: routers skip it)."""
REGISTER_ROLES = (*INSTANCE_ROLES, CACHE_SERVER_ROLE)
MAX_TEXT = 256
"""Longest model name, fingerprint, salt or address."""
MAX_TIERS = 16
TOKEN_MAX = 2**31 - 1
_INT_BOUNDS = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 65536, "chunk_size": 1 << 20,
               "tp_size": 4096}


def check_id(value: str, what: str = "instance_id") -> str:
    """``value`` if it is a valid id; INVALID_ARGUMENT naming ``what`` otherwise."""
    if not ID_RE.fullmatch(value):
        raise invalid(f"{what} must match {ID_RE.pattern}, got {value[:64]!r}")
    return value


def check_text(value: str, what: str, empty_ok: bool = True) -> str:
    """``value`` if printable and short enough (and non-empty unless ``empty_ok``); INVALID_ARGUMENT otherwise."""
    if len(value) > MAX_TEXT or (not empty_ok and not value) or not value.isprintable():
        raise invalid(f"{what} must be printable, 1-{MAX_TEXT} characters")
    return value


def check_tokens(token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The ids as a list; RESOURCE_EXHAUSTED past ``max_tokens``, INVALID_ARGUMENT if empty or out of range."""
    if len(token_ids) > max_tokens:
        raise exhausted(f"{len(token_ids)} tokens exceed the limit of {max_tokens}")
    if not token_ids:
        raise invalid("token_ids is empty")
    ids = list(token_ids)
    if min(ids) < 0 or max(ids) > TOKEN_MAX:
        raise invalid(f"token ids must be in [0, {TOKEN_MAX}]")
    return ids


def check_digests(digests: Sequence[bytes], what: str) -> list[bytes]:
    """The digests as a list if each has ``KEY_BYTES`` bytes; INVALID_ARGUMENT otherwise."""
    for d in digests:
        if len(d) != KEY_BYTES:
            raise invalid(f"{what}: a chunk digest has {len(d)} bytes, expected {KEY_BYTES}")
    return list(digests)


# --- namespaces and registrations -------------------------------------------------------
def namespace_from_wire(msg: pb.ModelNamespace) -> tuple[Namespace, bool]:
    """The kvlayer ``Namespace`` (and ``save_partial_chunks``) an instance registered."""
    for name, top in _INT_BOUNDS.items():
        value = getattr(msg, name)
        if not 0 < value <= top:
            raise invalid(f"namespace.{name} must be in [1, {top}], got {value}")
    check_text(msg.model_name, "namespace.model_name", empty_ok=False)
    check_text(msg.model_fingerprint, "namespace.model_fingerprint")
    check_text(msg.salt, "namespace.salt")
    if not 0 <= msg.tp_rank < msg.tp_size:
        raise invalid(f"namespace.tp_rank {msg.tp_rank} outside tp_size {msg.tp_size}")
    if msg.format_version <= 0:
        raise invalid(f"namespace.format_version must be positive, got {msg.format_version}")
    try:
        dtype = parse_dtype(msg.dtype)
    except ValueError as e:
        raise invalid(f"namespace.dtype: {e}") from None
    check_text(msg.cache_layout, "namespace.cache_layout")
    windows = _layer_windows(msg)
    # block_size does not enter keys; 1 stands in for the engine's.
    try:
        layout = KVLayout(msg.num_layers, msg.num_kv_heads, msg.head_dim, dtype, 1,
                          cache_layout=msg.cache_layout or DEFAULT_CACHE_LAYOUT, layer_windows=windows)
        ns = Namespace(msg.model_name, msg.model_fingerprint, layout, msg.chunk_size, msg.tp_rank, msg.tp_size,
                       msg.salt, msg.format_version, quantization=msg.storage_quantization or "none")
    except ValueError as e:  # an unknown cache layout or quantization
        raise invalid(f"namespace: {e}") from None
    return ns, msg.save_partial_chunks


def namespace_to_wire(ns: Namespace, save_partial_chunks: bool) -> pb.ModelNamespace:
    """The wire form of ``ns`` (``namespace_from_wire`` inverts it)."""
    lay = ns.layout
    return pb.ModelNamespace(
        model_name=ns.model_name, model_fingerprint=ns.model_fingerprint, dtype=dtype_name(lay.dtype),
        num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
        chunk_size=ns.chunk_size, tp_rank=ns.tp_rank, tp_size=ns.tp_size, format_version=ns.format_version,
        salt=ns.salt, save_partial_chunks=save_partial_chunks,
        cache_layout="" if lay.cache_layout == DEFAULT_CACHE_LAYOUT else lay.cache_layout,
        storage_quantization="" if ns.quantization == "none" else ns.quantization,
        layer_windows=[w or 0 for w in lay.layer_windows] if lay.windowed else [])


def _layer_windows(msg: pb.ModelNamespace) -> tuple[int | None, ...]:
    """The registered per-layer windows (0 on the wire: full attention), checked; ``()`` for none."""
    windows = list(msg.layer_windows)
    if windows and len(windows) != msg.num_layers:
        raise invalid(f"namespace.layer_windows has {len(windows)} entries for {msg.num_layers} layers")
    if any(w < 0 for w in windows):
        raise invalid(f"namespace.layer_windows must be >= 0 (0: full attention), got {min(windows)}")
    return tuple(w or None for w in windows) if any(windows) else ()


def spec_from_wire(msg: pb.Register) -> InstanceSpec:
    """The registration, checked: id, address, role, served model name, namespace and 1-16 distinct tiers."""
    check_id(msg.instance_id)
    check_text(msg.address, "address")
    check_text(msg.served_model, "register.served_model")
    role = msg.role or "both"  # an instance older than the role field
    if role not in REGISTER_ROLES:
        raise invalid(f"register.role must be one of {REGISTER_ROLES} (or empty), got {role[:40]!r}")
    if not msg.HasField("namespace"):
        raise invalid("register.namespace is missing")
    ns, partial = namespace_from_wire(msg.namespace)
    if len(msg.tiers) > MAX_TIERS:
        raise invalid(f"at most {MAX_TIERS} tiers, got {len(msg.tiers)}")
    tiers = []
    for t in msg.tiers:
        if not TIER_RE.fullmatch(t.name):
            raise invalid(f"tier names must match {TIER_RE.pattern}, got {t.name[:40]!r}")
        if t.shared_id:
            check_id(t.shared_id, "tier.shared_id")
        if t.hosted and not t.shared_id:
            raise invalid(f"tier {t.name!r} is hosted but has no shared_id")
        tiers.append(TierSpec(t.name, t.rank, t.in_memory, t.shared_id, t.cannot_pin, t.hosted))
    if len({t.name for t in tiers}) != len(tiers):
        raise invalid("tier names must be distinct")
    return InstanceSpec(msg.instance_id, msg.address, ns, partial, tuple(tiers), role, msg.served_model)


def tier_to_wire(tier: TierSpec) -> pb.TierInfo:
    """The wire form of a registered tier."""
    return pb.TierInfo(name=tier.name, rank=tier.rank, in_memory=tier.in_memory, shared_id=tier.shared_id,
                       cannot_pin=tier.cannot_pin, hosted=tier.hosted)


STAT_FIELDS = ("used_bytes", "capacity_bytes", "lookups", "lookup_chunks", "lookup_hit_chunks", "hit_tokens",
               "get_chunks", "put_chunks", "evictions", "errors", "timeouts")
"""The counters a heartbeat carries per tier (plus ``healthy``), named as in kvlayer's tier stats."""


def hit_rate(values: dict[str, int]) -> float:
    """A tier's lookup hit rate in [0, 1]: the chunks its lookups found first in it per chunk they
    asked for (``lookup_hit_chunks / lookup_chunks``); 0 while no chunk was asked for. The two
    counters are read one after the other, so the ratio is capped at 1."""
    asked = values.get("lookup_chunks", 0)
    return min(1.0, values.get("lookup_hit_chunks", 0) / asked) if asked > 0 else 0.0


def stats_from_wire(beat: pb.Heartbeat, spec: InstanceSpec) -> dict[str, dict[str, int]]:
    """A heartbeat's counters per tier (negative values and unknown tiers refused)."""
    out = {}
    for t in beat.tiers:
        if spec.tier(t.tier) is None:
            raise invalid(f"heartbeat names unknown tier {t.tier[:40]!r}")
        values = {name: getattr(t, name) for name in STAT_FIELDS}
        if min(values.values(), default=0) < 0:
            raise invalid("heartbeat counters cannot be negative")
        out[t.tier] = {**values, "healthy": int(t.healthy)}
    return out
