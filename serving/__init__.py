"""``kvlayer serve``: an OpenAI-compatible HTTP server over the bundled engine (docs/serving.md).

``engine_loop`` runs the one engine loop that batches every connection's requests;
``text`` turns token ids into streamed text and applies stop strings; ``protocol`` holds the
request models and OpenAI's error JSON; ``chat`` renders chat messages into a prompt;
``completions`` answers the two generation endpoints; ``app`` wires routes, auth, limits and
metrics; ``cli`` is the ``kvlayer serve`` command (docs/architecture.md section 11).
"""
