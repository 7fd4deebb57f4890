"""``Session``: the controller's end of one instance's stream.

Commands for the instance go into ``outbox`` (the stream handler writes them out) and the
caller awaits the instance's ``CommandReply``, with a deadline: a command is never fire and
forget. When the stream ends every waiting command fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from kvlayer.controller import controller_pb2 as pb
from kvlayer.controller.errors import RequestError, exhausted, unavailable

MAX_PENDING = 64
"""Commands one instance may have in flight."""


class Session:
    """Outgoing messages and pending commands of one connected instance (event loop only)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.outbox: asyncio.Queue[pb.ControllerMessage] = asyncio.Queue()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._pending: dict[int, asyncio.Future[pb.CommandReply]] = {}
        self._ids = itertools.count(1)

    async def request(self, command: pb.Command, timeout_s: float) -> pb.CommandReply:
        """Send ``command`` (its id is set here) and wait for the instance's reply.

        Raises ``RequestError``: UNAVAILABLE if the stream is or becomes closed,
        DEADLINE_EXCEEDED after ``timeout_s``, RESOURCE_EXHAUSTED with too many in flight.
        A reply with ``ok`` false is returned, not raised.
        """
        if self.closed.is_set():
            raise unavailable(f"instance {self.instance_id!r} is disconnected")
        if timeout_s <= 0:  # never send what nobody will wait for
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "no time left to run the command")
        if len(self._pending) >= MAX_PENDING:
            raise exhausted(f"instance {self.instance_id!r} has {MAX_PENDING} commands in flight")
        command_id = next(self._ids)
        command.command_id = command_id
        fut: asyncio.Future[pb.CommandReply] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = fut
        try:
            self.outbox.put_nowait(pb.ControllerMessage(command=command))
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"instance {self.instance_id!r} did not answer within {timeout_s:.1f} s") from None
        finally:
            self._pending.pop(command_id, None)

    def resolve(self, reply: pb.CommandReply) -> bool:
        """Hand ``reply`` to its waiting command; False if none waits (late or unknown id)."""
        fut = self._pending.get(reply.command_id)
        if fut is None or fut.done():
            return False
        fut.set_result(reply)
        return True

    def close(self, reason: str) -> None:
        """End the session: the stream handler stops and waiting commands fail (idempotent)."""
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(unavailable(f"instance {self.instance_id!r}: {reason}"))
