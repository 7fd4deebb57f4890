"""What an instance does with a controller command: one handler per ``Action``.

Handlers run on the agent's worker thread and call the instance's ``KVCacheEngine`` (its admin
operations, ``kvlayer.tier_admin`` underneath), whose tier calls carry their own deadlines. A
handler's failure becomes a reply with ``ok`` false and the error's text (the controller
answers FAILED_PRECONDITION); it never escapes into the instance. A pin or unpin naming a tier
that cannot pin (Redis) is such a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.controller import controller_pb2 as pb
from kvlayer.keys import ChunkKey
from kvlayer.tier_admin import Outcome

log = logging.getLogger(__name__)

MAX_LISTED_PINS = 10_000
"""Pinned chunks a pins listing names per tier (the counts cover all of them)."""


class Done(NamedTuple):
    """A handler's answer, as ``CommandReply`` carries it (see the .proto for each field)."""

    chunks: int
    tokens: int
    skipped_pinned: int = 0
    missing: int = 0
    pins: tuple[pb.TierPins, ...] = ()


Handler = Callable[[KVCacheEngine, pb.Command, list[ChunkKey]], Done]
"""(kv, command, the command's chunk keys) -> what it did."""


def covered(keys: Sequence[ChunkKey], n: int) -> int:
    """Tokens of the first ``n`` keys."""
    return keys[min(n, len(keys)) - 1].end if n and keys else 0


def _tier(command: pb.Command) -> str | None:
    return command.tier or None


def _pinnable_tier(kv: KVCacheEngine, command: pb.Command) -> str | None:
    """The command's tier (None: every tier, the pinnable ones pinning); ``ValueError`` when the
    named tier cannot pin: a pin there would silently do nothing."""
    if not command.tier:
        return None
    pinnable = kv.pinnable_tiers()
    if command.tier in kv.tier_names and command.tier not in pinnable:
        raise ValueError(f"tier {command.tier!r} cannot pin; tiers that can: {pinnable}")
    return command.tier


def _pin(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    n = kv.pin(keys, _pinnable_tier(kv, command))
    return Done(n, covered(keys, len(keys)) if n else 0)


def _unpin(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    n = kv.unpin(keys, _pinnable_tier(kv, command))
    return Done(n, covered(keys, len(keys)) if n else 0)


def _from_outcome(outcome: Outcome, tokens: int) -> Done:
    return Done(outcome.done, tokens, outcome.skipped_pinned, outcome.missing)


def _evict(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    tiers = [command.tier] if command.tier else [t for t in kv.tier_names if t not in command.keep_tiers]
    outcome = kv.evict(keys, tiers)
    return _from_outcome(outcome, covered(keys, len(keys)) if outcome.done else 0)


def _evict_all(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    removed = kv.evict_all(_tier(command))
    return Done(removed, 0, skipped_pinned=sum(len(chunks) for chunks in kv.pinned(_tier(command)).values()))


def _copy(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    outcome = kv.copy_prefix(keys, command.dst_tier, _tier(command))
    return _from_outcome(outcome, covered(keys, outcome.held))


def _move(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    if not command.tier:
        raise ValueError("a move needs its source tier")
    outcome = kv.move(keys, command.dst_tier, command.tier)
    return _from_outcome(outcome, covered(keys, outcome.held))


def _list_pins(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> Done:
    listing = kv.pinned(_tier(command), keys if command.token_ids else None)
    pins = tuple(pb.TierPins(tier=tier, chunks=len(chunks), pins=sum(n for _, n, _ in chunks),
                             listed=[pb.PinnedChunk(digest=d, pins=n, end=end)
                                     for d, n, end in chunks[:MAX_LISTED_PINS]])
                 for tier, chunks in listing.items())
    return Done(sum(p.chunks for p in pins), 0, pins=pins)


HANDLERS: dict[int, Handler] = {
    pb.ACTION_PIN: _pin, pb.ACTION_UNPIN: _unpin, pb.ACTION_EVICT: _evict, pb.ACTION_EVICT_ALL: _evict_all,
    pb.ACTION_COPY: _copy, pb.ACTION_MOVE: _move, pb.ACTION_LIST_PINS: _list_pins,
}
_NEEDS_PREFIX = frozenset(HANDLERS) - {pb.ACTION_EVICT_ALL, pb.ACTION_LIST_PINS}


def check(command: pb.Command, actions: frozenset[int] = frozenset(HANDLERS)) -> None:
    """``ValueError`` for an action not in ``actions``, or one that needs a prefix and has none."""
    if command.action not in actions:
        raise ValueError(f"unknown action {command.action}")
    if command.action in _NEEDS_PREFIX and not command.token_ids:
        raise ValueError("this action needs token_ids")


def command_salt(command: pb.Command) -> str | None:
    """The command's ``cache_salt``; None when absent (the instance's default)."""
    return command.cache_salt if command.HasField("cache_salt") else None


def reply(command: pb.Command, done: Done) -> pb.CommandReply:
    """The successful reply to ``command`` carrying ``done``."""
    out = pb.CommandReply(command_id=command.command_id, ok=True, chunks=done.chunks, tokens=done.tokens,
                          skipped_pinned=done.skipped_pinned, missing=done.missing)
    out.pins.extend(done.pins)
    return out


def failure(command: pb.Command, error: Exception) -> pb.CommandReply:
    """The reply to ``command`` that failed with ``error`` (logged at info: the instance goes on)."""
    log.info("kvlayer agent: command %s failed: %s", pb.Action.Name(command.action)
             if command.action in pb.Action.values() else command.action, error)
    return pb.CommandReply(command_id=command.command_id, ok=False, error=f"{type(error).__name__}: {error}"[:1000])


def run_command(kv: KVCacheEngine, command: pb.Command) -> pb.CommandReply:
    """Carry out ``command`` on ``kv``; never raises (a failure is a reply with ``ok`` false)."""
    try:
        check(command)
        keys = kv.keys(list(command.token_ids), command_salt(command)) if command.token_ids else []
        return reply(command, HANDLERS[command.action](kv, command, keys))
    except Exception as e:  # the controller gets the error; the instance goes on
        return failure(command, e)
