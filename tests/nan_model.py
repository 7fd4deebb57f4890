"""A real model fault for isolation tests: a model folder whose embedding of one token is NaN.

Any request whose tokens include ``token`` gets NaN hidden states, KV and logits from the model
itself (no hook, no fake): the engine must fail that request alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

NAN_TOKEN = 7
"""The token whose embedding row is NaN in ``nan_embedding_model``'s folders."""


def nan_embedding_model(src: str | Path, dst: Path, token: int = NAN_TOKEN) -> str:
    """Copy model folder ``src`` to ``dst`` with embedding row ``token`` set to NaN; returns ``dst``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)
