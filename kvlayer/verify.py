"""Sampled hit verification: a hit recomputed and compared with what the tiers hold (docs/architecture.md section 14).

A KV cache's worst failure is a silent wrong hit: KV that passes its checksum but belongs to
other tokens (a bug upstream stored it under the wrong key). Checksums cannot see it; only the
model can. With ``verify_fraction`` > 0 the scheduler half (``kvlayer.requests``) treats that
share of hits as misses, so the engine computes those tokens itself, and the step that would
have saved their chunks hands them here instead (``SaveSpec.verify_upto``):

1. the fresh KV of each chunk object is gathered out of the engine's cache into staging;
2. the stored copy is read from the tier that holds it, whole (a lower tier's checksum and,
   with ``storage_quantization``, its decoding run as on any hit);
3. both are compared within a tolerance (``agrees``): the recompute may run in another batch
   than the one that stored the chunk, so kernels differ in their last bits, and a quantized
   tier's copy differs by its encoding's error;
4. agreement counts ``verified_hits`` on that tier; a mismatch counts ``verify_mismatches``,
   logs the key and tier, removes the object from every tier and stores the fresh KV in its
   place, so later requests hit the right KV.

Nothing here raises into the engine: verification costs one recompute per sampled hit and,
when it fails below, the check (logged), never the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlayer import tier_admin
from kvlayer.keys import ChunkKey
from kvlayer.memory import MemoryObj
from kvlayer.memory import release_all as _release
from kvlayer.pipeline import group_pieces
from kvlayer.quantize import QUANTIZERS
from kvlayer.read_plan import ChunkReads, ReadPlan
from kvlayer.staging import Staging
from kvlayer.tier_manager import TierManager
from kvlayer.transfer import CopyPlan, wait_for_copies

log = logging.getLogger(__name__)

RTOL: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.float16: 2**-6, torch.bfloat16: 2**-5}
"""Per dtype, the difference allowed between a recompute and the stored KV, relative to the
chunk's largest magnitude: a few of the dtype's ulps at that magnitude, which a recompute in
another batch stays within and the KV of other tokens does not. Other dtypes (fp8 caches) get
``DEFAULT_RTOL``."""
DEFAULT_RTOL = 2**-3


@dataclass(frozen=True, slots=True)
class VerifyItem:
    """Compare the chunk objects ``keys`` (whole chunks or layer groups' objects,
    ``kvlayer.windows.save_keys``) of request ``request_id`` with its cache: ``slots`` holds the
    copy row of each token ``0..keys[-1].end-1`` (int64, the caches' device; as ``SaveItem``, and
    like it ``[groups, rows]`` with ``layer_groups``, the group of each model layer)."""

    request_id: str
    keys: tuple[ChunkKey, ...]
    slots: torch.Tensor
    layer_groups: tuple[int, ...] = ()


def agrees(fresh: torch.Tensor, stored: torch.Tensor, quantization: str = "none") -> bool:
    """Whether ``stored`` (a chunk as a tier gave it back) is ``fresh`` (the same chunk as the
    engine computed it now) up to ``RTOL`` of ``fresh``'s largest magnitude, plus the encoding's
    error bound where the tier stores ``quantization`` (``kvlayer.quantize``). Same shapes."""
    f = fresh.float()
    s = stored.float()
    if not bool(torch.isfinite(s).all()):
        return False
    bound = RTOL.get(fresh.dtype, DEFAULT_RTOL) * float(f.abs().amax()) if f.numel() else 0.0
    diff = (f - s).abs()
    if quantization in QUANTIZERS and fresh.dim() == 5:
        return bool((diff <= QUANTIZERS[quantization].error_bound(fresh) + bound).all())
    return bool((diff <= bound).all())


class Verification:
    """One step's verifications: built with the step (it finds which objects the tiers hold and
    stages a chunk for each), ``run(caches)`` once after the forward pass. Owns the staging
    chunks it allocated and releases them in ``run`` (or ``close``)."""

    def __init__(self, tiers: TierManager, staging: Staging, items: Sequence[VerifyItem], quantization: str) -> None:
        self._tiers = tiers
        self._staging = staging
        self._quantization = quantization
        self._chunks: list[tuple[str, ChunkKey, int, MemoryObj, VerifyItem]] = []
        objs = [(item, key) for item in items for key in item.keys]
        held = tiers.lookup_many([[key] for _, key in objs], record=False) if objs else []
        for (item, key), found in zip(objs, held):
            if not found.num_chunks:
                continue  # evicted since the lookup: nothing to compare with
            obj = staging.allocate(key)
            if obj is None:
                break  # staging is full: the rest go unchecked this time
            self._chunks.append((item.request_id, key, found.sources[0], obj, item))

    def __len__(self) -> int:
        return len(self._chunks)

    def run(self, caches: Sequence[torch.Tensor], failed: dict[str, int]) -> None:
        """Gather each object's fresh KV out of ``caches`` (one per layer), read the stored copy,
        compare, count, and replace the wrong ones; objects of a request in ``failed`` past its
        valid tokens are skipped (their KV was not computed). Never raises (logged)."""
        chunks = [c for c in self._chunks if c[1].end <= failed.get(c[0], c[1].end)]
        skipped = [c for c in self._chunks if c not in chunks]
        self._chunks = []
        _release(c[3] for c in skipped)
        if not chunks:
            return
        try:
            layout = self._staging.layout
            pieces = [piece for _, key, _, obj, item in chunks
                      for piece in group_pieces(layout, layout.chunk_view(obj.tensor), key, key.start, key.end,
                                                item.slots, item.layer_groups, ())]
            copies = CopyPlan([(rows, slots) for rows, slots, _ in pieces], layers=[ids for _, _, ids in pieces])
            copies.gather(caches)
            wait_for_copies(caches[0].device)
            self._compare(chunks)
        except Exception:
            log.exception("kvlayer: verifying %d sampled hits failed; they count as neither", len(chunks))
        finally:
            _release(c[3] for c in chunks)

    def _compare(self, chunks: list[tuple[str, ChunkKey, int, MemoryObj, VerifyItem]]) -> None:
        plans = [ReadPlan((key,), (src,)) for _, key, src, _, _ in chunks]
        reads = ChunkReads.open(self._tiers, plans, self._staging, [(0, self._staging.layout.num_layers)])
        try:
            reads.wait_layer(self._staging.layout.num_layers - 1)
            counts = reads.finish(credit=False)
            wrong: list[tuple[ChunkKey, MemoryObj]] = []
            for (_, key, src, fresh, _), got, n in zip(chunks, reads.objs, counts, strict=True):
                if not n:
                    continue  # gone or corrupted since the lookup: the read counted it
                tier = self._tiers.guarded[src]
                quantization = "none" if tier.in_memory else self._quantization
                if agrees(fresh.tensor, got[0].tensor, quantization):
                    tier.metrics.inc("verified_hits")
                    continue
                tier.metrics.inc("verify_mismatches")
                log.error("kvlayer: a sampled hit's stored KV differs from the recomputed KV: key %s "
                          "(tokens %d-%d) in tier %s; removed from every tier, replaced by the recomputed KV",
                          key.digest.hex(), key.start, key.end, tier.name)
                wrong.append((key, fresh))
        finally:
            reads.release()
        if wrong:
            self._replace(wrong)

    def _replace(self, wrong: list[tuple[ChunkKey, MemoryObj]]) -> None:
        keys = [key for key, _ in wrong]
        tier_admin.remove(self._tiers, keys)
        self._tiers.flush(self._tiers.op_timeout)  # a removal must not race the rewrite below
        self._tiers.store(keys, [obj for _, obj in wrong])

    def close(self) -> None:
        """Release the staged chunks without verifying (the step's saves were dropped)."""
        chunks, self._chunks = self._chunks, []
        _release(c[3] for c in chunks)
