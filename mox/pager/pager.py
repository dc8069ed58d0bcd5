"""The expert pager: each model's experts stream from disk (or the host cache) into a budgeted
slot pool on the compute device, on demand, and stay while they are worth their slot.

`ExpertPager` is what the models share: the I/O (a streaming reader, an optional host cache),
the clock, and one lock over every pool's tables. `add_model` returns the model's `ModelPool`
(mox.pager.model_pool), which does the rest: waves of leases, prefetch, resizing, statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mox.loaders import Checkpoint
from mox.loaders.stream import StreamingReader
from mox.pager.expert_loader import ExpertLoader
from mox.pager.host_cache import HostCache
from mox.pager.model_pool import ModelPool
from mox.pager.paging import PagerShared


class ExpertPager:
    def __init__(self, loader: ExpertLoader, clock: Callable[[], float] = time.monotonic):
        self.shared = PagerShared(loader, clock)

    @property
    def loader(self) -> ExpertLoader:
        return self.shared.loader

    def add_model(self, name: str, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                  num_slots: int | None, policy: str = "rate",
                  prefetch: bool = False) -> ModelPool:
        """The model's pool of `num_slots` expert slots (None: every expert; 0: parked until
        resized). `policy`: its eviction policy; `prefetch`: predictive prefetch on."""
        return ModelPool(self.shared, name, ckpt, dtype, device, num_slots, policy, prefetch)


def make_pager(device: torch.device, host_memory_bytes: int | None = None,
               direct_io: bool = False,
               clock: Callable[[], float] = time.monotonic) -> ExpertPager:
    """A pager with its reader and (if `host_memory_bytes`) a host cache, pinned on CUDA."""
    host = (HostCache(host_memory_bytes, pin_memory=device.type == "cuda")
            if host_memory_bytes else None)
    return ExpertPager(ExpertLoader(StreamingReader(direct=direct_io), host), clock)
