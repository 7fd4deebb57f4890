"""``kvlayer cache-server``: one machine's CPU tier in shared memory, shared by engine processes.

The server (``server.py``, started by ``kvlayer cache-server``) owns a shared-memory arena and an
index of the chunks in it; engine processes reach it through the ``cache`` tier (``tier.py``),
which sends control messages over a Unix socket (``protocol.py``) and copies KV bytes straight
between the engine's memory and the mapped arena (docs/architecture.md section 15,
docs/cache-server.md). Importing this package imports nothing: the server needs no torch.
"""
