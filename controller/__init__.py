"""kvlayer's cache controller (docs/architecture.md section 7): see the fleet's cache from one place.

- ``kvlayer.controller.server``: the gRPC server (``kvlayer controller``): a registry of which
  instance holds which chunks per tier, admin RPCs, the standard health service.
- ``kvlayer.controller.agent``: the instance side, started by the connector when
  ``controller_url`` is set; a background thread that never blocks the engine.
- ``kvlayer.controller.client``: ``AdminClient`` and ``best_instance`` (KV-aware routing):
  ``from kvlayer.controller.client import best_instance``.
- ``kvlayer.controller.cli``: ``kvlayer controller`` and ``kvlayer admin``.

Importing this package is light (no grpc) and imports none of its modules: each of them
imports the package (for the generated ``controller_pb2``), so the package importing one back
would be a cycle.
"""
