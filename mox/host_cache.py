"""The host tier: a byte-budgeted LRU cache of experts' raw checkpoint bytes in RAM, between
the disk and the device pools (pinned when the device is a GPU, so copies can be async).

Thread-safe. On CPU the OS page cache plays this role, so it is off by default there.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

CacheKey = tuple[str, int, int]        # (model, moe_layer, expert)


class HostCache:
    def __init__(self, budget_bytes: int, pin_memory: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self._entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, key: CacheKey) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def put(self, key: CacheKey, data: torch.Tensor) -> None:
        nbytes = data.numel()
        if nbytes > self.budget_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            while self._used + nbytes > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self._used -= old.numel()
            self._entries[key] = data
            self._used += nbytes
