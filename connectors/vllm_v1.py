"""``KVLayerConnectorV1``: kvlayer as a vLLM V1 KV connector (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVLayerConnectorV1",
        "kv_connector_module_path": "kvlayer.connectors.vllm_v1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_capacity": "8GiB", "nvme_path": "/mnt/nvme/kv"}}'

vLLM builds one instance per role: the scheduler's in its engine-core process
(``vllm_scheduler.SchedulerSide``) and one per worker (``vllm_worker.WorkerSide``, which owns the
tiers). They share only vLLM's per-step metadata (the step layer's ``StepSpec``) and the lookup
channel (``lookup_channel``). This class translates vLLM's interface (``KVConnectorBase_V1``, as
installed) into those two and nothing more (docs/architecture.md section 10); docs/vllm.md says
how loads, saves, async loads, resets and vLLM's KV-cache events (``BlockStored``,
``BlockRemoved`` for what enters and leaves kvlayer's tiers) go through it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

from kvlayer.connectors import vllm_setup as setup
from kvlayer.connectors.lookup_channel import LookupClient, socket_path
from kvlayer.connectors.vllm_groups import kv_cache_groups
from kvlayer.connectors.vllm_scheduler import RankedLookups, SchedulerSide
from kvlayer.connectors.vllm_worker import WorkerSide
from kvlayer.step import StepSpec
from kvlayer.tier_events import Stored, TierEvent

log = logging.getLogger(__name__)


class KVLayerStats(KVConnectorStats):
    """kvlayer's counts for vLLM's connector stats (``kvlayer.step_stats.STAT_NAMES``): plain ints,
    summed over steps and workers; vLLM logs them as "KV Transfer metrics"."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVLayerStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVLayerKVEvents(KVConnectorKVEvents):
    """The KV-cache events of one step's workers (vLLM's ``KVConnectorKVEvents``), each worker's
    appended to the first one's by vLLM. ``aggregate`` keeps every event: each tensor-parallel
    rank's chunks have keys of their own (the rank is in the namespace), none common to all."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), num_workers: int = 1) -> None:
        self._events = list(events)
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVLayerKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []

    def __repr__(self) -> str:
        return f"<KVLayerKVEvents workers={self._workers} events={len(self._events)}>"


def vllm_events(records: Sequence[TierEvent], chunk_size: int) -> list[KVCacheEvent]:
    """vLLM's events for kvlayer's tier records (``kvlayer.tier_events``): a ``BlockStored`` per stored
    run, one "block" per chunk of ``chunk_size`` tokens, and a ``BlockRemoved`` per removed run.
    The hashes are kvlayer's chunk digests as vLLM's ``maybe_convert_block_hash`` turns its own
    into event hashes (the low 64 bits as an int by default; the bytes with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); the medium is ``kvlayer:<tier>``."""
    out: list[KVCacheEvent] = []
    for rec in records:
        hashes = [_hash(d) for d in rec.digests]
        medium = f"kvlayer:{rec.tier}"
        if isinstance(rec, Stored):
            parent = _hash(rec.parent) if rec.parent is not None else None
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(rec.token_ids),
                                   block_size=chunk_size, lora_id=None, medium=medium, lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium))
    return out


def _hash(digest: bytes) -> ExternalBlockHash:
    return maybe_convert_block_hash(BlockHash(digest))


def _tp_rank(tp: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    if tp == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _events_on(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (``kv_events_config.enable_kv_cache_events``): vLLM
    takes the connector's events at every step, but drops them unless they are on."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


class KVLayerConnectorV1(KVConnectorBase_V1, SupportsHMA):
    """kvlayer's vLLM connector; ``vllm_config.kv_transfer_config.kv_connector_extra_config``
    holds kvlayer's config keys (``kvlayer.connectors.vllm_setup.kvlayer_config``). A bad key
    or value stops vLLM's start-up with kvlayer's one-line ``ConfigError``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._config = setup.with_served_name(setup.kvlayer_config(transfer.kv_connector_extra_config), vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        setup.check_block_size(self._config, self._block_size)
        self._groups = kv_cache_groups(kv_cache_config, self._block_size)
        """vLLM's KV-cache groups (several under its hybrid manager; docs/vllm.md, "Hybrid models")."""
        self._per_request_failures = self._groups is not None and self._groups.num_groups > 1
        parallel = vllm_config.parallel_config
        self._tp = int(parallel.tensor_parallel_size)
        pp = int(getattr(parallel, "pipeline_parallel_size", 1))
        if pp != 1:
            raise ValueError(f"kvlayer's vLLM connector runs with pipeline_parallel_size 1 for now, got {pp}")
        self._engine_id = str(transfer.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._clients: list[LookupClient] = []
        self._events_on = _events_on(vllm_config)
        self._events: list[KVCacheEvent] = []  # the scheduler side's, until take_events
        self.events_lost = 0
        """Steps whose events were dropped by a failure here (logged once)."""
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                # vLLM reads the policy right after building this side: kvlayer is a cache, so a
                # chunk that fails to load (a dead tier, a corrupt file) is recomputed, not an error
                log.warning("kvlayer: kv_load_failure_policy %r -> 'recompute' (a chunk that fails to load "
                            "is recomputed)", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            timeout = self._config.tier_timeout_ms / 1000
            self._clients = [LookupClient(socket_path(self._engine_id, r), timeout) for r in range(self._tp)]
            self._scheduler = SchedulerSide(self._config, RankedLookups(self._clients), self._block_size,
                                            self._groups)

    @property
    def requires_kv_delivery(self) -> bool:
        """kvlayer is a best-effort cache: a request never waits on a hand-off."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # kvlayer adapts to the backend's layout (vllm_setup.cache_layout)

    # ----- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        first = kv_caches[names[0]]
        model = self._vllm_config.model_config
        groups = self._groups
        if groups is not None and len(groups.layer_groups) != len(names):
            raise ValueError(f"vLLM's KV-cache groups name {len(groups.layer_groups)} layers, its caches {len(names)}")
        # each layer's window, for the window-aware tiers (only under vLLM's hybrid manager:
        # without it every layer's blocks hold every token, and kvlayer stores them all)
        windows = groups.layer_windows if groups is not None and self._config.window_aware else ()
        layout = setup.cache_layout(first, model.get_num_kv_heads(self._vllm_config.parallel_config),
                                    model.get_head_size(), self._block_size, first.dtype, len(names), windows)
        name, fingerprint = setup.model_identity(str(model.model), getattr(model, "revision", None))
        rank = _tp_rank(self._tp)
        engine = {"model_name": name, "model_fingerprint": fingerprint, "device": str(first.device),
                  "tp_rank": rank, "tp_size": self._tp}
        self._worker = WorkerSide(self._config, layout, socket_path(self._engine_id, rank), engine, self._events_on)
        self._worker.register(names, [kv_caches[n] for n in names])
        log.info("kvlayer: %d layers of %s (tensor-parallel rank %d of %d), tiers %s", len(names),
                 layout.cache_layout, rank, self._tp, self._worker.kv.tier_names)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, StepSpec):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.finish()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No saves are held (``request_finished`` answers False); the async loads done since the
        last call, each reported once, also for a request finished while its load ran (vLLM keeps
        its blocks until then). Each rank reports its own; vLLM waits for every rank's."""
        if self._worker is None:
            return None, None
        done = self._worker.finished_loads(finished_req_ids)
        self._worker.forget(finished_req_ids)
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s sets, and the requests whose async load failed. With several KV-cache
        groups vLLM cannot map block ids back to requests, so every load is async there
        (``SchedulerSide.loads_async``) and a failure is reported per request (vLLM recomputes)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.failed_loads() if self._worker is not None and self._per_request_failures else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.load_errors(with_async=not self._per_request_failures)

    def get_kv_connector_stats(self) -> KVLayerStats | None:
        counts = self._worker.take_stats() if self._worker is not None else {}
        return KVLayerStats(data=counts) if counts else None

    def get_kv_connector_kv_cache_events(self) -> KVLayerKVEvents | None:
        """What entered and left this worker's tiers since the last step, as vLLM's events; None
        if nothing did (or events are off). Never raises: a failure drops the events (logged)."""
        if self._worker is None:
            return None
        try:
            records = self._worker.take_events()
            return KVLayerKVEvents(vllm_events(records, self._config.chunk_size)) if records else None
        except Exception:
            self._lost_events("building")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVLayerStats:
        return KVLayerStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.close()
        for client in self._clients:
            client.close()

    # ----- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """kvlayer's hit after vLLM's own ``num_computed_tokens``, and whether it loads
        asynchronously (``async_loads``: a chunk from NVMe or Redis; ``SchedulerSide.loads_async``)."""
        assert self._scheduler is not None
        hit = self._scheduler.matched(request, num_computed_tokens)
        return hit, hit > 0 and self._scheduler.loads_async(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        ids = blocks.get_block_ids()  # one list per KV-cache group
        self._scheduler.allocated(request, ids[0], num_external_tokens, ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build(scheduler_output)  # type: ignore[return-value]

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if self._scheduler is not None and invalid:
            self._scheduler.load_failed(set(invalid))
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KVLayerKVEvents):
            try:
                self._events.extend(events.get_all_events())
            except Exception:
                self._lost_events("collecting")

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: ``SchedulerSide.reset``."""
        if self._scheduler is None:
            return None
        self._scheduler.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' events since the last call (vLLM publishes them after its own)."""
        events, self._events = self._events, []
        return events

    def _lost_events(self, doing: str) -> None:
        level = logging.DEBUG if self.events_lost else logging.WARNING
        self.events_lost += 1
        log.log(level, "kvlayer: %s the KV-cache events failed; they are dropped", doing, exc_info=True)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``'s ``request_finished``, with each KV-cache group's blocks: as there."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None
