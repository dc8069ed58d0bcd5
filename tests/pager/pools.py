"""Pools for the pager tests: a model's pool over a checkpoint on a fake clock."""

from __future__ import annotations

import torch

from mox.loaders import Checkpoint
from mox.pager import ModelPool, make_pager

CPU = torch.device("cpu")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def new_pool(ckpt: Checkpoint, num_slots: int | None, dtype=torch.float32, policy="lru",
             host_memory=None) -> ModelPool:
    pager = make_pager(CPU, host_memory, clock=FakeClock())
    return pager.add_model("m", ckpt, dtype, CPU, num_slots, policy)
