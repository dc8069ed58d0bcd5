"""The router's configuration: the memory policy, device and budgets, the loop's periods and
limits. On a CPU the server folds a host budget into the device budget (`one_ram_tier`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mox.errors import InvalidRequestError
from mox.router.served_model import resolve_device

ROUTER_POLICIES = ("rate", "lru", "lfu", "model-swap", "all-resident")
# Decode steps a batch of decodes runs back to back when nothing else waits for the engine:
# the steps' Python is paid once for these (bench/results/throughput-*.md). A run also ends
# after about `DEFAULT_DECODE_RUN_S` (its tokens stream out when it ends) and after any step
# where a request, an abort or loaded weights wait (mox.engine.scheduler), so what arrives
# waits for the step in progress, not for the run.
DEFAULT_DECODE_STEPS = 16


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "rate"
    device: str = "cpu"
    dtype: str | torch.dtype = "bfloat16"
    device_memory: int | None = None      # dense + expert bytes of all models; None: no limit
    host_memory: int | None = None        # RAM cache of expert bytes (None: off)
    kv_memory: int = 1 << 30
    max_batched_tokens: int = 256
    tpot_target_s: float | None = None    # the round the scheduler keeps (None: every model
                                          # with work runs; mox.engine.scheduler)
    decode_steps: int = DEFAULT_DECODE_STEPS   # most decode steps a batch alone runs back to
                                          # back (mox.engine.scheduler)
    prefetch: bool | None = None          # predictive expert prefetch (None: on for CUDA)
    direct_io: bool = True                # O_DIRECT reads (no page cache) where the filesystem
                                          # allows: the disk tier is really the disk
    plan_period_s: float = 1.0
    dense_idle_s: float = 300.0           # a warm model idle this long is parked
    max_waiting_per_model: int = 256
    max_waiting: int = 1024
    queue_timeout_s: float = 120.0
    compute_threads: int | None = None    # torch intra-op threads for steps (None: all,
                                          # less the cores other processes keep busy)
    max_compute_threads: int | None = None  # "all" above (None: the process's count at start)
    step_log: str | None = None           # append each step's record here (JSON lines)

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise InvalidRequestError(f"unknown policy {self.policy!r}; choose from "
                                      f"{ROUTER_POLICIES}", param="policy")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise InvalidRequestError(f"the TPOT target must be a positive time, not "
                                      f"{self.tpot_target_s!r} s", param="tpot_target")
        for name in ("decode_steps", "max_waiting_per_model", "max_waiting", "compute_threads",
                     "max_compute_threads", "max_batched_tokens", "kv_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1, not {value!r}",
                                          param=name)
        for name in ("queue_timeout_s", "dense_idle_s", "plan_period_s"):
            if not getattr(self, name) > 0:          # (NaN too)
                raise InvalidRequestError(f"{name} must be a positive time, not "
                                          f"{getattr(self, name)!r}", param=name)

    def one_ram_tier(self) -> RouterConfig:
        """The server's tiers on a CPU: expert slots and a host cache would be the same RAM,
        and a page-in from the cache a copy within it, so the host budget joins the slots'
        (one RAM tier above the disk). Elsewhere, or without a host budget: unchanged."""
        if resolve_device(self.device).type != "cpu" or not self.host_memory:
            return self
        device_memory = (None if self.device_memory is None
                         else self.device_memory + self.host_memory)
        return replace(self, device_memory=device_memory, host_memory=None)
