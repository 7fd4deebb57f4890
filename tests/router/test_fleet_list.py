"""Which instances the router keeps as the controller's list changes (router/fleet.py).

Run: ``.venv/bin/python -m pytest tests/router/test_fleet_list.py``. The controller's list is
given directly; the instances' HTTP answers come from an httpx transport that answers like
``kvlayer serve`` (``/v1/models``, ``/metrics``), or fails like a dead one.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from kvlayer.controller import controller_pb2 as pb
from kvlayer.router.fleet import Fleet


class ListedBy:
    """Stands for the controller: ``infos`` is what ListInstances answers (None: away)."""

    def __init__(self) -> None:
        self.infos: list[pb.InstanceInfo] | None = []

    async def instances(self) -> list[pb.InstanceInfo] | None:
        return self.infos


def info(iid: str, state: int = pb.INSTANCE_STATE_UP) -> pb.InstanceInfo:
    return pb.InstanceInfo(instance_id=iid, address=f"{iid}.test:8000", state=state,
                           namespace=pb.ModelNamespace(model_name="tiny"))


def run(view: ListedBy, dead: set[str], steps) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host.split(".")[0] in dead:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        return httpx.Response(200, text="kvlayer_serve_requests_running 1\n")

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            await steps(Fleet(view, http, forget_after_s=0.3))  # type: ignore[arg-type]
    asyncio.run(main())


def test_a_restarted_controller_that_lists_nobody_yet_does_not_empty_the_routing_set():
    view = ListedBy()

    async def steps(fleet: Fleet) -> None:
        view.infos = [info("a"), info("b")]
        await fleet.refresh()
        assert [i.instance_id for i in fleet.candidates("tiny")] == ["a", "b"]
        assert fleet.instances["a"].others_load == 1
        view.infos = []  # the controller restarted: nobody has registered again yet
        await fleet.refresh()
        assert [i.instance_id for i in fleet.candidates("tiny")] == ["a", "b"], "still answering: still routed"
        view.infos = [info("a", pb.INSTANCE_STATE_SYNCING)]  # a registers again, its snapshot streaming
        await fleet.refresh()
        assert [i.instance_id for i in fleet.candidates("tiny")] == ["a", "b"]
        time.sleep(0.35)  # b never registers again: forgotten after forget_after_s
        await fleet.refresh()
        assert [i.instance_id for i in fleet.candidates("tiny")] == ["a"]
        assert fleet.instances["a"].unlisted_since is None, "listed again: its grace is over"
    run(view, set(), steps)


def test_an_unlisted_instance_that_fails_its_probe_leaves_at_once_and_a_down_one_is_not_routed():
    view, dead = ListedBy(), set()

    async def steps(fleet: Fleet) -> None:
        view.infos = [info("a"), info("b"), info("c", pb.INSTANCE_STATE_DOWN)]
        await fleet.refresh()
        assert sorted(fleet.instances) == ["a", "b"], "a DOWN instance is not taken"
        dead.add("b")
        view.infos = [info("a")]
        await fleet.refresh()  # b fails its probe: out of the routing set ...
        assert [i.instance_id for i in fleet.candidates("tiny")] == ["a"]
        await fleet.refresh()  # ... and, unlisted and down, out of the list without waiting
        assert sorted(fleet.instances) == ["a"]
        view.infos = None  # the controller away: the last list is kept
        await fleet.refresh()
        assert sorted(fleet.instances) == ["a"]
    run(view, dead, steps)
