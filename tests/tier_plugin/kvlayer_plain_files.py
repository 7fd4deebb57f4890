"""``plainfiles``: a third-party kvlayer tier for tests, one plain file per chunk under ``root``.

Found by kvlayer through the ``kvlayer.backends`` entry point of this distribution
(``tests/tier_plugin/pyproject.toml``); its ``root`` setting, declared in
``kvlayer_plain_files_settings``, reaches it through ``BackendContext.tier_settings``. The file
of chunk K is ``<root>/<K hex>.chunk``: K's tokens digest, then the chunk tensor's bytes.
Deliberately simple (no checksum, blocking file calls on the I/O loop): it shows the plug-in
path, not how to write a fast tier.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvlayer.keys import TOKENS_DIGEST_BYTES, ChunkKey
from kvlayer.layout import KVLayout
from kvlayer.memory import Arena, MemoryObj
from kvlayer.storage import BackendContext, StorageBackend, check_batch


class PlainFilesBackend(StorageBackend):
    """Chunks as files under ``root``; reads land in ``staging`` (one reference, the caller's)."""

    name = "plainfiles"
    rank = 25

    def __init__(self, root: Path, layout: KVLayout, staging: Arena) -> None:
        self.root = root
        self._layout = layout
        self._staging = staging

    @classmethod
    def create(cls, ctx: BackendContext) -> PlainFilesBackend | None:
        """The tier under its ``root`` setting (made if missing), None when that is unset."""
        root = ctx.tier_settings(cls.name)["root"]
        if root is None:
            return None
        Path(root).mkdir(parents=True, exist_ok=True)
        return cls(Path(root), ctx.layout, ctx.staging)

    def path(self, key: ChunkKey) -> Path:
        return self.root / f"{key.hex}.chunk"

    async def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        while n < len(keys) and self.path(keys[n]).is_file():
            n += 1
        return n

    async def get_many(self, keys: Sequence[ChunkKey]) -> list[MemoryObj | None]:
        return [self._read(key) for key in keys]

    def _read(self, key: ChunkKey) -> MemoryObj | None:
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        shape = self._layout.chunk_shape(key.num_tokens, len(key.layers))
        if data[:TOKENS_DIGEST_BYTES] != key.tokens_digest or len(data) != TOKENS_DIGEST_BYTES + self._bytes(shape):
            return None  # another chunk's file, or a truncated one: a miss
        obj = self._staging.allocate(shape, self._layout.dtype)
        if obj is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)[TOKENS_DIGEST_BYTES:]
            obj.tensor.copy_(payload.view(self._layout.dtype).view(shape))
        return obj

    def _bytes(self, shape: tuple[int, ...]) -> int:
        return torch.Size(shape).numel() * torch.empty((), dtype=self._layout.dtype).element_size()

    async def put_many(self, keys: Sequence[ChunkKey], chunks: Sequence[MemoryObj]) -> None:
        check_batch(keys, chunks, self._layout)
        stored = []
        for key, chunk in zip(keys, chunks, strict=True):
            path = self.path(key)
            if path.exists():
                continue
            body = chunk.tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            temporary = path.with_suffix(".tmp")
            temporary.write_bytes(key.tokens_digest + body)
            os.replace(temporary, path)  # a reader never sees half a chunk
            stored.append(key.digest)
        self._admitted(stored)

    async def remove(self, keys: Sequence[ChunkKey]) -> int:
        gone = []
        for key in keys:
            try:
                self.path(key).unlink()
            except FileNotFoundError:
                continue
            gone.append(key.digest)
        self._evicted(gone)
        return len(gone)

    def usage(self) -> tuple[int, int]:
        return sum(p.stat().st_size for p in self.root.glob("*.chunk")), 0
