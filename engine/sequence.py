"""One request as the engine tracks it: its tokens, blocks, progress and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from kvlayer.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Sequence:
    """A request: ``token_ids`` is the prompt followed by the tokens generated so far.

    ``num_computed_tokens`` tokens have their KV in ``block_table``'s blocks; the first
    ``num_freed_blocks`` entries are ``block_manager.FREED_BLOCK`` (released: out of every
    sliding window's reach).
    ``num_cached_tokens``/``num_external_tokens`` record the engine's prefix-cache hits and
    the connector's loaded tokens at the request's last admission.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None, prompt: str | None = None,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        """Why the request failed (finish reason "error"), in one line."""
        self.scrub_kv = False
        """Its logits were not finite: the KV of blocks only it holds is zeroed before they are
        freed, so no later owner's masked slots read NaN or infinity."""
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_freed_blocks = 0
        self.num_hashed_blocks = 0
        self.last_block_hash: bytes | None = None
        self.num_cached_tokens = 0
        self.num_external_tokens = 0
        self.partial_kv_before = 0
        """Blocks starting before this position hold only some layers' KV (a window-aware load,
        ``KVConnectorBase.get_kv_complete_from``): never registered in the prefix cache."""
        self.num_preemptions = 0
        self.times = RequestTimes(time.perf_counter() if arrival_time is None else arrival_time)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
