"""``kvlayer serve``: an OpenAI-compatible HTTP server over the bundled engine (docs/serving.md).

``engine_loop`` runs the one engine loop that batches every connection's requests;
``text`` turns token ids into streamed text and applies stop strings; ``protocol`` holds the
request models and OpenAI's error JSON; ``chat`` renders chat messages into a prompt;
``completions`` answers the two generation endpoints; ``app`` wires routes, auth, limits and
metrics; ``cli`` is the ``kvlayer serve`` command (docs/architecture.md section 11).
``http`` (body limit, API-key check, error handlers) and ``listener`` (port, key files,
uvicorn) are shared with ``kvlayer router`` and, with ``protocol`` and ``metrics``, import
neither the engine nor torch.
"""
