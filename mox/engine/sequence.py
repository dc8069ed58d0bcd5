"""A request as the engine tracks it while it runs: the sequence of its tokens.

A sequence moves WAITING -> RUNNING -> FINISHED; a preempted one goes back to WAITING with
its KV freed and is recomputed (prompt plus the tokens it already produced) when readmitted.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from mox.messages import FinishReason, Request
from mox.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0       # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = self.request.prompt_token_ids
        return (prompt + self.output_token_ids)[start:end]
