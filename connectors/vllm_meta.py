"""What the vLLM connector's scheduler side tells its workers each step (docs/vllm.md).

Plain frozen dataclasses of ints, strings and tuples: vLLM carries them from the engine-core
process to the workers (it pickles them itself, in its own channel); kvlayer adds no
serialisation of its own. Token ids travel with each spec because the worker computes the
chunk keys in its own namespace (its tensor-parallel rank is part of it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of request ``request_id`` (``token_ids`` are its tokens
    ``0..end-1``) into its vLLM blocks ``block_ids`` (those covering ``0..end-1``), each found
    chunk from the tier the lookup named (``sources``). ``start`` and ``end`` are on block
    boundaries."""

    request_id: str
    salt: str | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    sources: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the full chunks of tokens ``[first, len(token_ids))`` of request ``request_id``,
    whose KV is in its blocks ``block_ids`` (those covering ``token_ids``)."""

    request_id: str
    salt: str | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    first: int


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """One engine step's loads and saves (vLLM's ``KVConnectorMetadata`` for kvlayer)."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
