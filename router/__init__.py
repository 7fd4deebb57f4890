"""``kvlayer router``: an OpenAI-compatible proxy that sends each request to the instance that
holds its prefix (docs/fleet.md, docs/architecture.md section 11).

``controller_view`` asks the controller for the instances and for prefix lookups, each with a
deadline; ``fleet`` keeps the live instances, their served models and loads; ``policy``
ranks them for a request; ``proxy`` forwards a request (retrying once, streaming, P/D);
``app`` wires the routes; ``cli`` is the ``kvlayer router`` command.
"""

POLICIES = ("kv", "round-robin", "random", "least-loaded")
"""The routing policies (router/policy.py says what each does)."""
DEFAULT_LOAD_COST = 256
"""Prompt tokens one running or waiting request is worth under ``kv``: an instance must cache
this many more tokens per extra request to be preferred."""
