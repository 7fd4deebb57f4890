"""A Hugging Face model folder's files, for any engine: its safetensors files and a fingerprint.

``model_fingerprint(folder)`` identifies the weights cheaply, for kvlayer's key namespace
(docs/architecture.md section 3): it reads headers and a fixed sample of each file, not the
whole file. The bundled engine (``kvlayer.engine.loader``) and the vLLM connector both use it,
so the same folder gets the same fingerprint whoever serves it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


class ModelLoadError(ValueError):
    """A checkpoint that does not match its config, or a corrupt or truncated file; the message
    names the tensor or file. A ValueError: the model folder given is bad input."""


def checkpoint_files(path: str | Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every ``*.safetensors``."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelLoadError(
                f"{INDEX_FILE} in {str(folder)!r} has no valid weight_map: {error!r}"
            ) from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"shard {file.name!r} named in {INDEX_FILE} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(folder)!r}")
    return files


def model_fingerprint(path: str | Path) -> str:
    """A hex blake2b digest of config.json and, per safetensors file, its header and 16 evenly
    spaced 64 KiB samples of its data: stable across processes, fast for any model size."""
    folder = Path(path)
    digest = hashlib.blake2b(digest_size=32)
    config = folder / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"config.json is missing from model folder {str(folder)!r}")
    _update(digest, b"config.json", config.read_bytes())
    for file in checkpoint_files(folder):
        size = file.stat().st_size
        with file.open("rb") as stream:
            head = stream.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if 8 + header_len > size:
                raise ModelLoadError(f"{str(file)!r} is corrupt or truncated: its header runs past the end of the file")
            _update(digest, file.name.encode(), stream.read(header_len))
            data_start = 8 + header_len
            data_len = size - data_start
            for offset in _sample_offsets(data_len):
                stream.seek(data_start + offset)
                _update(digest, offset.to_bytes(8, "little"), stream.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(data_len: int) -> list[int]:
    """Where the samples start: the whole data when it is small, else 16 evenly spaced windows."""
    if data_len <= _SAMPLES * _SAMPLE_BYTES:
        return list(range(0, data_len, _SAMPLE_BYTES))
    last = data_len - _SAMPLE_BYTES
    return [i * last // (_SAMPLES - 1) for i in range(_SAMPLES)]


def _update(digest: hashlib.blake2b, label: bytes, data: bytes) -> None:
    """Feed ``label`` and ``data``, each length-prefixed so boundaries cannot shift."""
    for part in (label, data):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
