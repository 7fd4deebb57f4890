"""How ``kvlayer admin`` shows the controller's answers: rich tables, or plain data for ``--json``.

One renderer per answer type, found by the message's type (no dispatch on strings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from kvlayer.controller import controller_pb2 as pb

_STATE = {pb.INSTANCE_STATE_SYNCING: "syncing", pb.INSTANCE_STATE_UP: "up", pb.INSTANCE_STATE_DOWN: "down"}


def to_dict(answer: Message) -> dict[str, Any]:
    """The answer as plain data (field names as in the .proto, every field present, int64 as numbers)."""
    return json_format.MessageToDict(answer, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, unquote_int64_if_possible=True)


def failures(answer: Message) -> str | None:
    """One line naming the instances a command's (or pins listing's) answer reports as failed,
    with their errors; None when none failed (or ``answer`` is neither)."""
    if isinstance(answer, pb.CommandResponse):
        results = list(answer.results)
    elif isinstance(answer, pb.PinsResponse):
        results = list(answer.instances)
    else:
        return None
    failed = [r for r in results if not r.ok]
    if not failed:
        return None
    errors = "; ".join(f"{r.instance_id}: {' '.join(r.error.split())}" for r in failed)
    return f"failed on {len(failed)} of {len(results)} instances: {errors}"


def print_answer(answer: Message, console: Console | None = None) -> None:
    """Print ``answer`` (an admin RPC's response) as a table."""
    console = console or Console(width=160)
    console.print(_RENDERERS[type(answer)](answer))


def _instances(answer: pb.ListInstancesResponse) -> Table:
    t = Table("instance", "state", "role", "model", "served as", "tiers", "chunks", "last seen", "address",
              title="instances")
    for i in answer.instances:
        tiers = ", ".join(f"{x.name}{' (shared)' if x.shared_id else ''}" for x in i.tiers)
        t.add_row(i.instance_id, _STATE.get(i.state, "?"), i.role or "both", i.namespace.model_name,
                  i.served_model or "-", tiers, str(i.chunks), f"{i.last_seen_s:.1f} s ago", i.address or "-")
    return t


def _stats(answer: pb.StatsResponse) -> Table:
    """Per instance and tier; "hit rate" is the share of the chunks lookups asked for that the tier
    answered ("-" while its kvlayer counts no looked-up chunks)."""
    t = Table("instance", "state", "tier", "chunks", "used", "capacity", "lookups", "hit rate",
              "hit tokens", "evictions", "errors", "healthy", title="stats")
    for s in answer.instances:
        state = _STATE.get(s.info.state, "?")
        for x in s.tiers:
            rate = f"{x.hit_rate:.1%}" if x.lookup_chunks else "-"
            t.add_row(s.info.instance_id, state, x.tier, str(x.chunks), _bytes(x.used_bytes), _bytes(x.capacity_bytes),
                      str(x.lookups), rate, str(x.hit_tokens), str(x.evictions), str(x.errors + x.timeouts),
                      "yes" if x.healthy else "NO")
        if not s.tiers:
            t.add_row(s.info.instance_id, state, "-", *[""] * 9)
    return t


def _lookup(answer: pb.LookupResponse) -> Table:
    t = Table("rank", "instance", "cached tokens", "per tier", "address",
              title=f"lookup of {answer.num_tokens} tokens (best first)")
    for rank, m in enumerate(answer.matches, 1):
        per_tier = ", ".join(f"{x.tier} {x.prefix_tokens}" for x in m.tiers)
        t.add_row(str(rank), m.instance_id, f"{m.cached_tokens}/{answer.num_tokens}", per_tier, m.address or "-")
    return t


def _command(answer: pb.CommandResponse) -> Table:
    """One row per instance step: "chunks" is what it did (pinned, unpinned, evicted, copied or
    moved), "pinned (kept)" what it left because it is pinned, "missing" what was not there."""
    t = Table("instance", "step", "ok", "chunks", "pinned (kept)", "missing", "tokens", "error", title="result")
    for r in answer.results:
        t.add_row(r.instance_id, r.action or "-", "yes" if r.ok else "NO", str(r.chunks), str(r.skipped_pinned),
                  str(r.missing), str(r.tokens), r.error or "")
    return t


def _pins(answer: pb.PinsResponse) -> Table:
    """Per instance and tier: pinned chunks and the pins they hold; chunks named by digest (and, for a
    prefix, the tokens through each), at most ``_PIN_ROWS`` per tier (``--json`` has the rest)."""
    t = Table("instance", "tier", "pinned chunks", "pins", "chunk", "pins of it", "through token", title="pins")
    for i in answer.instances:
        if not i.ok:
            t.add_row(i.instance_id, "-", "", "", "", "", "", style="red")
        for x in i.tiers:
            t.add_row(i.instance_id, x.tier, str(x.chunks), str(x.pins), "", "", "")
            for c in x.listed[:_PIN_ROWS]:
                t.add_row("", "", "", "", c.digest.hex()[:16], str(c.pins), str(c.end) if c.end else "-")
            if len(x.listed) > _PIN_ROWS or x.chunks > len(x.listed):
                t.add_row("", "", "", "", f"... {x.chunks - min(len(x.listed), _PIN_ROWS)} more", "", "")
    return t


_PIN_ROWS = 20


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_RENDERERS: dict[type, Callable[[Any], Table]] = {
    pb.ListInstancesResponse: _instances, pb.StatsResponse: _stats, pb.LookupResponse: _lookup,
    pb.CommandResponse: _command, pb.PinsResponse: _pins,
}
