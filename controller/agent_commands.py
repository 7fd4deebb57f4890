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

from kvlayer.cache_engine import KVCacheEngine
from kvlayer.controller import controller_pb2 as pb
from kvlayer.keys import ChunkKey

log = logging.getLogger(__name__)

Handler = Callable[[KVCacheEngine, pb.Command, list[ChunkKey]], tuple[int, int]]
"""(kv, command, the command's chunk keys) -> (chunks affected, tokens of the prefix acted on)."""


def _covered(keys: Sequence[ChunkKey], n: int) -> int:
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


def _pin(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    n = kv.pin(keys, _pinnable_tier(kv, command))
    return n, _covered(keys, len(keys)) if n else 0


def _unpin(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    n = kv.unpin(keys, _pinnable_tier(kv, command))
    return n, _covered(keys, len(keys)) if n else 0


def _evict(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    tiers = [command.tier] if command.tier else [t for t in kv.tier_names if t not in command.keep_tiers]
    n = sum(kv.remove(keys, t) for t in tiers)
    return n, _covered(keys, len(keys)) if n else 0


def _evict_all(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    return kv.evict_all(_tier(command)), 0


def _copy(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    n = kv.copy(keys, command.dst_tier, _tier(command))
    return n, _covered(keys, n)


def _move(kv: KVCacheEngine, command: pb.Command, keys: list[ChunkKey]) -> tuple[int, int]:
    if not command.tier:
        raise ValueError("a move needs its source tier")
    n = kv.copy(keys, command.dst_tier, command.tier)
    kv.remove(keys[:n], command.tier)
    return n, _covered(keys, n)


HANDLERS: dict[int, Handler] = {
    pb.ACTION_PIN: _pin, pb.ACTION_UNPIN: _unpin, pb.ACTION_EVICT: _evict, pb.ACTION_EVICT_ALL: _evict_all,
    pb.ACTION_COPY: _copy, pb.ACTION_MOVE: _move,
}
_NEEDS_PREFIX = frozenset(HANDLERS) - {pb.ACTION_EVICT_ALL}


def run_command(kv: KVCacheEngine, command: pb.Command) -> pb.CommandReply:
    """Carry out ``command`` on ``kv``; never raises (a failure is a reply with ``ok`` false)."""
    reply = pb.CommandReply(command_id=command.command_id)
    handler = HANDLERS.get(command.action)
    try:
        if handler is None:
            raise ValueError(f"unknown action {command.action}")
        if command.action in _NEEDS_PREFIX and not command.token_ids:
            raise ValueError("this action needs token_ids")
        salt = command.cache_salt if command.HasField("cache_salt") else None
        keys = kv.keys(list(command.token_ids), salt) if command.token_ids else []
        reply.chunks, reply.tokens = handler(kv, command, keys)
        reply.ok = True
    except Exception as e:  # the controller gets the error; the instance goes on
        log.info("kvlayer agent: command %s failed: %s", pb.Action.Name(command.action)
                 if command.action in pb.Action.values() else command.action, e)
        reply.ok, reply.error = False, f"{type(e).__name__}: {e}"[:1000]
    return reply
