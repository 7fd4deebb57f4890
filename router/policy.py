"""How the router ranks the candidate instances for one request (best first).

- ``kv``: each instance scores ``local_hit - load_cost * load``: the leading prompt tokens its
  own tiers hold (from the controller's lookup; tokens in a shared tier such as Redis count
  for nobody, every instance can read them) minus ``load_cost`` tokens per running or waiting
  request. The highest score wins; ties go to the least loaded, then in turn. When nothing is
  cached anywhere, or the lookup did not answer, it is ``least-loaded``.
- ``least-loaded``: fewest running plus waiting requests; ties in turn.
- ``round-robin``: each request starts one instance further along.
- ``random``: a random order (``seed`` makes it reproducible).

The proxy tries the first instance and, when it fails before answering, the second.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence

from kvlayer.router import DEFAULT_LOAD_COST, POLICIES
from kvlayer.router.controller_view import PrefixHit
from kvlayer.router.fleet import Instance


class Policy:
    """One of ``POLICIES``. ``rank`` never returns an empty list for candidates."""

    def __init__(self, name: str, load_cost: float = DEFAULT_LOAD_COST, seed: int | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}")
        if load_cost < 0:
            raise ValueError(f"load_cost must be >= 0, got {load_cost}")
        self.name = name
        self.load_cost = load_cost
        self._turn = itertools.count()
        self._rng = random.Random(seed)

    @property
    def needs_lookup(self) -> bool:
        return self.name == "kv"

    def rank(self, candidates: Sequence[Instance], hits: Mapping[str, PrefixHit] | None = None) -> list[Instance]:
        """``candidates`` best first for a request whose prefix ``hits`` the controller found."""
        if not candidates:
            return []
        turn = next(self._turn)
        n = len(candidates)
        rotated = [candidates[(turn + i) % n] for i in range(n)]  # "in turn" among equals
        if self.name == "round-robin":
            return rotated
        if self.name == "random":
            order = list(candidates)
            self._rng.shuffle(order)
            return order
        local = {i.instance_id: (hits or {}).get(i.instance_id, PrefixHit(0, 0)).local for i in candidates}
        if self.name == "least-loaded" or not any(local.values()):
            return sorted(rotated, key=lambda i: i.load)
        return sorted(rotated, key=lambda i: (-(local[i.instance_id] - self.load_cost * i.load), i.load))

    def score(self, inst: Instance, hit: PrefixHit | None) -> float:
        """``kv``'s score of ``inst`` (for logs and tests)."""
        return (hit.local if hit else 0) - self.load_cost * inst.load
