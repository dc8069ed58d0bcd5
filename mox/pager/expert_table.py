"""One model's experts as the Triton kernels address them on a GPU, so a decode step never asks
the host which experts are resident (DESIGN.md: "the hot path never asks the host").

`row_of [L, E]` (int32, on the device) gives each expert a row of `rows` (`ExpertRows`):
- row L*E + s: slot s of the pools;
- row l*E + e: expert (l, e) read in place from the host cache (pinned host memory, mapped
  into the device's address space), where its bytes are there and laid out as a slot;
- NOT_RESIDENT: its bytes are only on disk (the step must page: `complete` is False).
Mapped rows come first so their numbers do not move when the pools grow.

The pager keeps it current between steps: `refresh` (under the pager's lock, as a step's hold
starts) applies the slot changes since the last refresh, maps evicted experts the host cache
holds, and drops mapped experts the host cache evicted (their bytes would otherwise stay
allocated outside its budget). The host tables are copied to the device once per refresh that
changed them. Not thread-safe: the pager calls it under its lock.

Legend: L MoE layers, E experts per layer, S slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mox.kernels import NOT_RESIDENT, ExpertRows, MappedExpert, rows_aligned
from mox.pager.eviction import ExpertKey
from mox.pager.host_cache import CacheKey, HostCache
from mox.pager.slot_pool import SlotPool

# (layer, expert) -> the expert as the kernels may read it in place, or None
MapExpert = Callable[[ExpertKey], MappedExpert | None]


@dataclass(frozen=True)
class ExpertMap:
    """The table as one step reads it (a refresh makes a new one: a step's kernels never see
    it change): `row_of [L, E]` on the device and its host copy, and the rows it indexes,
    which keep the mapped bytes alive."""

    row_of: torch.Tensor
    row_of_host: np.ndarray
    rows: ExpertRows
    first_slot_row: int
    complete: bool          # every expert has a row: a step computes any routing without asking

    def is_mapped(self, layer: int, expert: int) -> bool:
        return NOT_RESIDENT < self.row_of_host[layer, expert] < self.first_slot_row


class ExpertTable:
    def __init__(self, pool: SlotPool, host_cache: HostCache | None, name: str,
                 map_expert: MapExpert) -> None:
        self.pool, self.host_cache, self.name = pool, host_cache, name
        self.map_expert = map_expert
        self.first_slot_row = pool.num_layers * pool.num_experts
        self.mapped: dict[ExpertKey, MappedExpert] = {}
        self.row_of_host = np.full((pool.num_layers, pool.num_experts), NOT_RESIDENT,
                                   dtype=np.int32)
        self.current: ExpertMap | None = None
        self._base: tuple | None = None          # the pools' addresses the offsets count from
        self._host_evictions = -1                # host_cache.evictions at the last check

    def refresh(self) -> ExpertMap:
        """The table brought up to the pool's slots and the host cache's contents."""
        pool = self.pool
        changed = pool.take_map_changes()
        base = (pool.w13.data_ptr(), pool.w2.data_ptr(), pool.num_slots,
                None if pool.fmt is None else (pool.w13_scale.data_ptr(),
                                               pool.w2_scale.data_ptr()))
        dirty = self.current is None or base != self._base
        if changed is None or self.current is None:     # reallocated or compacted: every key
            changed = {(layer, expert) for layer in range(pool.num_layers)
                       for expert in range(pool.num_experts)}
        if self.host_cache is not None and self.host_cache.evictions != self._host_evictions:
            self._host_evictions = self.host_cache.evictions
            gone = [key for key, m in self.mapped.items()
                    if not self.host_cache.holds(self._cache_key(key), m.w2)]
            for key in gone:
                del self.mapped[key]
            changed |= set(gone)
            dirty |= bool(gone)        # (a new snapshot lets the dropped bytes go)
        for key in changed:
            dirty |= self._place(key)
        if dirty:
            self._base = base
            rows_host = self.row_of_host.copy()
            self.current = ExpertMap(torch.from_numpy(rows_host).to(pool.device), rows_host,
                                     self._rows(), self.first_slot_row,
                                     bool((rows_host != NOT_RESIDENT).all()))
        return self.current

    def _cache_key(self, key: ExpertKey) -> CacheKey:
        return (self.name, *key)

    def _place(self, key: ExpertKey) -> bool:
        """Set the key's row from its slot, or else its mapping; whether the table moved."""
        layer, expert = key
        slot, newly_mapped = self.pool.lookup(key), False
        if slot == NOT_RESIDENT and key not in self.mapped:
            found = self.map_expert(key)
            if found is not None:     # (kept while resident too: an eviction just flips back)
                self.mapped[key] = found
                newly_mapped = True
        if slot != NOT_RESIDENT:
            row = self.first_slot_row + slot
        else:
            row = layer * self.pool.num_experts + expert if key in self.mapped else NOT_RESIDENT
        moved = self.row_of_host[layer, expert] != row
        self.row_of_host[layer, expert] = row
        return bool(moved) or newly_mapped

    def _rows(self) -> ExpertRows:
        """Element offsets of every row from the pools' first elements: mapped rows where
        mapped (0 elsewhere: no row_of entry points there), then the slots. (The mapped
        experts come laid out as slots, checked as the loader maps them; a quantized pool
        maps none, so their scales' rows stay unused.)"""
        pool = self.pool
        pools = [pool.w13, pool.w2] + ([pool.w13_scale, pool.w2_scale] if pool.fmt else [])
        keys = list(self.mapped)
        rows = np.fromiter((layer * pool.num_experts + expert for layer, expert in keys),
                           dtype=np.int64, count=len(keys))
        addresses = np.array([_addresses(self.mapped[key]) for key in keys],
                             dtype=np.int64).reshape(len(keys), 4)
        tables = []
        for j, tensor in enumerate(pools):
            table = np.zeros(self.first_slot_row + pool.num_slots, dtype=np.int64)
            table[rows] = (addresses[:, j] - tensor.data_ptr()) // tensor.element_size()
            table[self.first_slot_row:] = np.arange(pool.num_slots) * tensor.stride(0)
            tables.append(table)
        offsets = [torch.from_numpy(table).to(pool.device) for table in tables]
        scales = offsets[2:] if pool.fmt is not None else [None, None]
        return ExpertRows(offsets[0], offsets[1], *scales, mapped=tuple(self.mapped.values()),
                          aligned=rows_aligned([*tables[0].tolist(), *tables[1].tolist()]))


def _addresses(m: MappedExpert) -> tuple[int, int, int, int]:
    """The mapped expert's parts' addresses (0: no scales)."""
    return tuple(0 if t is None else t.data_ptr() for t in (m.w13, m.w2, m.s13, m.s2))
