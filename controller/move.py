"""``MovePlanner``: a ``Move`` request as the commands that carry it out, in order.

- Within one instance (no ``dst_instance_id``): one command, ``ACTION_MOVE`` from ``src_tier``
  to ``dst_tier`` (``ACTION_COPY`` with ``keep_source``).
- To another instance: KV never crosses the controller; it goes through a tier both
  instances share (the same ``shared_id``, e.g. one Redis). The source copies the prefix into
  the shared tier, the destination copies it from there into ``dst_tier``, and unless
  ``keep_source`` the source then evicts its own copies outside the shared tier (``src_tier``
  only, when named). That last step (``MoveStep.drops_source``) is cut to the leading tokens
  both the shared tier and the destination hold by then, so a failed copy never loses the only
  copy. Both instances must compute the same chunk keys (same namespace), or the chunks could
  not match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.errors import invalid
from kvlayer.controller.registry import Instance

PrefixCommand = Callable[[Instance, pb.Prefix, int], pb.Command]
"""Builds a command of an action over a prefix, checked for an instance."""
TierCheck = Callable[[Instance, str, str, bool], str]
"""Checks a tier name for an instance (name, what, required) and returns it."""
LiveInstance = Callable[[str], Instance]


@dataclass(frozen=True, slots=True)
class MoveStep:
    """One command of a move, on ``instance``. ``drops_source``: the step removes the source's
    copies; the caller cuts its token ids to what the earlier steps delivered."""

    instance: Instance
    command: pb.Command
    drops_source: bool = False


class MovePlanner:
    """Plans moves with the admin servicer's own checks (each raises ``RequestError``)."""

    def __init__(self, prefix_command: PrefixCommand, tier: TierCheck, live: LiveInstance) -> None:
        self._command = prefix_command
        self._tier = tier
        self._live = live

    def plan(self, request: pb.MoveRequest) -> list[MoveStep]:
        """The steps of ``request``, in order; raises ``RequestError`` if it is malformed."""
        src = self._live(request.instance_id)
        if not request.dst_tier:
            raise invalid("move: dst_tier is required")
        if not request.dst_instance_id or request.dst_instance_id == request.instance_id:
            return self._local(src, request)
        return self._remote(src, self._live(request.dst_instance_id), request)

    def _local(self, src: Instance, request: pb.MoveRequest) -> list[MoveStep]:
        if request.via_tier:
            raise invalid("move: via_tier is only for moves to another instance")
        src_tier = self._tier(src, request.src_tier, "src_tier", True)
        dst_tier = self._tier(src, request.dst_tier, "dst_tier", True)
        if src_tier == dst_tier:
            raise invalid(f"move: src_tier and dst_tier are both {src_tier!r}")
        command = self._command(src, request.prefix, pb.ACTION_COPY if request.keep_source else pb.ACTION_MOVE)
        command.tier, command.dst_tier = src_tier, dst_tier
        return [MoveStep(src, command)]

    def _remote(self, src: Instance, dst: Instance, request: pb.MoveRequest) -> list[MoveStep]:
        push = self._command(src, request.prefix, pb.ACTION_COPY)
        pull = self._command(dst, request.prefix, pb.ACTION_COPY)
        salt = push.cache_salt if push.HasField("cache_salt") else None
        if (src.spec.namespace.with_salt(salt), src.spec.save_partial_chunks) != (
                dst.spec.namespace.with_salt(salt), dst.spec.save_partial_chunks):
            raise invalid(f"move: {src.instance_id!r} and {dst.instance_id!r} compute different chunk keys "
                          "(model, layout, parallelism or salt differ)")
        src_via, dst_via = _shared_tier(src, dst, request.via_tier)
        src_tier = self._tier(src, request.src_tier, "src_tier", False)
        dst_tier = self._tier(dst, request.dst_tier, "dst_tier", True)
        steps = []
        if src_tier != src_via:
            push.tier, push.dst_tier = src_tier, src_via
            steps.append(MoveStep(src, push))
        if dst_tier != dst_via:
            pull.tier, pull.dst_tier = dst_via, dst_tier
            steps.append(MoveStep(dst, pull))
        if not request.keep_source and src_tier != src_via:  # the shared copy itself always stays
            drop = self._command(src, request.prefix, pb.ACTION_EVICT)
            drop.tier = src_tier
            drop.keep_tiers.append(src_via)
            steps.append(MoveStep(src, drop, drops_source=True))
        return steps


def _shared_tier(src: Instance, dst: Instance, via: str) -> tuple[str, str]:
    """The names, on ``src`` and on ``dst``, of the tier both reach (``via`` names it on ``src``)."""
    pairs = []
    for tier in src.spec.tiers:
        if not tier.shared_id or (via and tier.name != via):
            continue
        match = next((t for t in dst.spec.tiers if t.shared_id == tier.shared_id), None)
        if match is not None:
            pairs.append((tier.name, match.name))
    if not pairs:
        named = f" named {via[:40]!r}" if via else ""
        raise invalid(f"move: {src.instance_id!r} and {dst.instance_id!r} share no tier{named}")
    if len(pairs) > 1:
        raise invalid(f"move: several shared tiers ({[p[0] for p in pairs]}); name one with via_tier")
    return pairs[0]
