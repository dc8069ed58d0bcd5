"""The host tier: a byte-budgeted LRU cache of experts' raw checkpoint bytes in RAM, between
the disk and the device pools (pinned when the device is a GPU, so copies can be async).

Thread-safe. On CPU the OS page cache plays this role, so it is off by default there.
The router may give a model a quota (its share of the cache): a model over its quota evicts
its own least recently used entries, so a burst on one model cannot flush the others.
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
        self._used_by: dict[str, int] = {}
        self._quota: dict[str, int] = {}
        self._lock = threading.Lock()
        self.evictions = 0           # entries dropped so far (holders of views check on change)

    def set_quota(self, model: str, quota_bytes: int | None) -> None:
        """Cap the model's share (None: only the global budget); shrinking evicts at once."""
        with self._lock:
            if quota_bytes is None:
                self._quota.pop(model, None)
            else:
                self._quota[model] = quota_bytes
                self._make_room(model, 0)

    def quota(self, model: str) -> int | None:
        return self._quota.get(model)

    def used_by(self, model: str) -> int:
        return self._used_by.get(model, 0)

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, key: CacheKey, touch: bool = True) -> torch.Tensor | None:
        """The entry (None: not cached); `touch`: counts as a use (LRU order)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and touch:
                self._entries.move_to_end(key)
            return entry

    def new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    def put(self, key: CacheKey, data: torch.Tensor) -> None:
        nbytes, model = data.numel(), key[0]
        with self._lock:
            if key in self._entries or nbytes > self._quota.get(model, self.budget_bytes):
                return
            self._make_room(model, nbytes)
            self._entries[key] = data
            self._used += nbytes
            self._used_by[model] = self._used_by.get(model, 0) + nbytes

    def _make_room(self, model: str, nbytes: int) -> None:
        """Evict LRU entries (the model's own first, past its quota) until `nbytes` fit."""
        quota = self._quota.get(model)
        if quota is not None:
            for key in [k for k in self._entries if k[0] == model]:
                if self._used_by.get(model, 0) + nbytes <= quota:
                    break
                self._drop(key)
        while self._used + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def holds(self, key: CacheKey, view: torch.Tensor) -> bool:
        """Whether the key's entry is still the buffer `view` lies in."""
        with self._lock:
            entry = self._entries.get(key)
            return (entry is not None and entry.data_ptr() <= view.data_ptr()
                    < entry.data_ptr() + entry.numel())

    def _drop(self, key: CacheKey) -> None:
        self.evictions += 1
        old = self._entries.pop(key)
        self._used -= old.numel()
        self._used_by[key[0]] -= old.numel()
