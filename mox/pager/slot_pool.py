"""One model's expert slot pool: `w13 [S, 2I, H]`, `w2 [S, H, I]` (and the biases `b13 [S, 2I]`,
`b2 [S, H]` of models whose experts have them; quantized experts as stored, with their scales)
on the compute device, any slot able to hold
any (MoE layer, expert), and the residency table `slot_of [L, E]` that the fused kernel reads
weights through (NOT_RESIDENT where an expert has no slot).

A slot is free, loading (reserved and pinned while its bytes arrive; not yet in `slot_of`, so
no kernel can read half an expert) or resident. Pinned slots (leased, or loading) are never
evicted, nor is anything while a kernel holds the pool (`holds`). The pool grows with every
expert keeping its slot (once no load is in flight), and shrinks once nothing is pinned. On a
GPU both reallocate and copy. On the CPU the tensors are
views of one anonymous mapping sized for every expert of the model, of which only the pages of
slots in use are backed: growing adds slots without a copy, and shrinking moves only the
residents above the new size into free slots below it and hands the tail's pages back to the
OS (`madvise(MADV_DONTNEED)`), so moving budget between models copies almost nothing. Not
thread-safe: the pager calls it under its lock.

Legend: L MoE layers, E experts per layer, S slots, H hidden, I intermediate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mox.kernels import NOT_RESIDENT, ExpertRows, ExpertScales, WeightFormat, expert_rows
from mox.loaders.experts import (
    DOWN,
    DOWN_BIAS,
    DOWN_BLOCKS,
    DOWN_SCALE,
    DOWN_SCALES,
    DOWN_T,
    GATE,
    GATE_SCALE,
    GATE_UP_BIAS,
    GATE_UP_BLOCKS,
    GATE_UP_SCALES,
    GATE_UP_T,
    UP,
    UP_SCALE,
)
from mox.pager.eviction import ExpertKey
from mox.pager.mapped import MappedTensor


@dataclass
class Slot:
    key: ExpertKey | None = None
    pins: int = 0
    loading: bool = False
    prefetched: bool = False      # loaded ahead of use; the first use counts a prefetch hit
    last_use: object = None       # CUDA event after the last kernel that read it (GPU only)

    @property
    def is_evictable(self) -> bool:
        return self.key is not None and self.pins == 0 and not self.loading


class SlotPool:
    def __init__(self, num_layers: int, num_experts: int, hidden: int, inter: int,
                 dtype: torch.dtype, device: torch.device, num_slots: int,
                 has_bias: bool = False, fmt: WeightFormat | None = None) -> None:
        """`fmt`: the experts are stored quantized (their weights in its storage dtype, and
        float32 scales beside them); `dtype` is then the biases' and the compute dtype."""
        self.num_layers, self.num_experts = num_layers, num_experts
        self.hidden, self.inter, self.dtype, self.device = hidden, inter, dtype, device
        self.has_bias, self.fmt = has_bias, fmt
        self.slot_of = torch.full((num_layers, num_experts), NOT_RESIDENT, dtype=torch.int32,
                                  device=device)                          # [L, E]
        self._slot_of_host = [[NOT_RESIDENT] * num_experts for _ in range(num_layers)]
        self.target_slots = num_slots
        # kernel calls reading the live table (ModelPool.holding): while any runs, nothing
        # is evicted and the tensors neither move nor grow
        self.holds = 0
        self._mapped: list[MappedTensor] | None = None
        if device.type == "cpu":                 # sized for every expert the model has
            self._mapped = [MappedTensor(shape, part_dtype) for shape, part_dtype
                            in self._part_shapes(num_layers * num_experts)]
        self._allocate(num_slots)

    def _part_shapes(self, num_slots: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of w13 [S, 2I, H], w2 [S, H, I] (stored shapes where quantized),
        their scales [S, 2, nb, kb] and [S, nb, kb] where quantized, and b13 [S, 2I],
        b2 [S, H] where the experts have biases."""
        hidden, inter, fmt = self.hidden, self.inter, self.fmt
        if fmt is None:
            parts = [((num_slots, 2 * inter, hidden), self.dtype),
                     ((num_slots, hidden, inter), self.dtype)]
        else:
            parts = [((num_slots, *fmt.stored_shape(2 * inter, hidden)), fmt.storage_dtype),
                     ((num_slots, *fmt.stored_shape(hidden, inter)), fmt.storage_dtype),
                     ((num_slots, 2, *fmt.scale_shape(inter, hidden)), torch.float32),
                     ((num_slots, *fmt.scale_shape(hidden, inter)), torch.float32)]
        if self.has_bias:
            parts += [((num_slots, 2 * inter), self.dtype), ((num_slots, hidden), self.dtype)]
        return parts

    def _allocate(self, num_slots: int) -> None:
        if self._mapped is not None:
            parts = [m.tensor for m in self._mapped]
        else:
            parts = [torch.empty(shape, dtype=part_dtype, device=self.device)
                     for shape, part_dtype in self._part_shapes(num_slots)]
        self.w13, self.w2 = parts[0], parts[1]
        self.w13_scale, self.w2_scale = (parts[2], parts[3]) if self.fmt else (None, None)
        self.b13, self.b2 = (parts[-2], parts[-1]) if self.has_bias else (None, None)
        self.slots = [Slot() for _ in range(num_slots)]
        self._num_occupied = 0
        self._in_use: tuple | None = None     # ((size, w13 address), in_use()'s tensors)
        # keys whose slot_of entry changed since the expert table last took them (None: all)
        self._map_changes: set[ExpertKey] | None = None

    def in_use(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None, ExpertScales | None, ExpertRows]:
        """w13, w2, b13, b2, the scales and the slots' row table (the Triton kernels read
        each slot through it) over the slots of the current size (the mapped tensors span
        every expert; a kernel sizes its per-slot work by the first dim)."""
        n = self.num_slots
        key = (n, self.w13.data_ptr())       # (every wave asks; slicing five tensors is not free)
        if self._in_use is None or self._in_use[0] != key:
            scales = (None if self.fmt is None else
                      ExpertScales(self.fmt, self.w13_scale[:n], self.w2_scale[:n]))
            w13, w2 = self.w13[:n], self.w2[:n]
            self._in_use = key, (w13, w2, None if self.b13 is None else self.b13[:n],
                                 None if self.b2 is None else self.b2[:n], scales,
                                 expert_rows(w13, w2, scales))
        return self._in_use[1]

    def _parts(self) -> list[torch.Tensor]:
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale, self.b13, self.b2)
                if t is not None]

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert takes in a slot (as stored: quantized weights and their scales)."""
        return sum(math.prod(shape[1:]) * part_dtype.itemsize
                   for shape, part_dtype in self._part_shapes(1))

    def destination(self, index: int, role: str) -> torch.Tensor:
        """The view of slot `index` that a stored expert part of this `role` fills with one
        `copy_(part.view(dst.shape))`: strided where the stored layout differs (GPT-OSS
        stores gate_up transposed with gate and up interleaved)."""
        inter, w13, w2 = self.inter, self.w13[index], self.w2[index]
        if role == GATE:
            return w13[:inter]                                            # [I, H]
        if role == UP:
            return w13[inter:]
        if role == DOWN:
            return w2                                                     # [H, I]
        if role == GATE_UP_T:        # stored [H, 2I] = [H, I, (gate, up)]
            return w13.view(2, inter, self.hidden).permute(2, 1, 0)
        if role == GATE_UP_BLOCKS:   # MXFP4, stored [2I, H/32, 16] = [I, (gate, up), H/2]
            return w13.view(2, inter, -1).transpose(0, 1)
        if role == GATE_UP_SCALES:   # stored [2I, H/32] = [I, (gate, up), H/32]
            return self.w13_scale[index].view(2, inter, -1).transpose(0, 1)
        if role == DOWN_BLOCKS:      # [H, I/32, 16]
            return w2
        if role == DOWN_SCALES:
            return self.w2_scale[index]
        if role == DOWN_T:           # stored [I, H]
            return w2.t()
        if role == GATE_SCALE:
            return self.w13_scale[index, 0]                               # [nb, kb]
        if role == UP_SCALE:
            return self.w13_scale[index, 1]
        if role == DOWN_SCALE:
            return self.w2_scale[index]
        if role == GATE_UP_BIAS:     # stored [2I] = [I, (gate, up)]
            return self.b13[index].view(2, inter).t()
        if role == DOWN_BIAS:
            return self.b2[index]
        raise ValueError(f"no slot destination for expert part role {role!r}")

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_occupied(self) -> int:
        """Resident or loading: what the budget counts (kept as a count: asked per lease)."""
        return self._num_occupied

    @property
    def is_quiet(self) -> bool:
        return not self.holds and all(s.pins == 0 and not s.loading for s in self.slots)

    def lookup(self, key: ExpertKey) -> int:
        """The slot holding `key` resident, or NOT_RESIDENT (also while it is loading)."""
        return self._slot_of_host[key[0]][key[1]]

    def loading_slot(self, key: ExpertKey) -> int:
        for index, slot in enumerate(self.slots):
            if slot.key == key and slot.loading:
                return index
        return NOT_RESIDENT

    def free_slots(self, count: int) -> list[int]:
        """Up to `count` empty slots that the budget allows filling now (slots past the
        target size are draining; an over-budget pool has none)."""
        count = min(count, self.target_slots - self._num_occupied)
        found: list[int] = []
        for index in range(min(self.num_slots, self.target_slots)):
            if len(found) >= count:
                break
            if self.slots[index].key is None:
                found.append(index)
        return found

    def evictable(self) -> list[int]:
        if self.holds:
            return []
        return [i for i, s in enumerate(self.slots) if s.is_evictable]

    def reserve(self, index: int, key: ExpertKey, prefetched: bool) -> None:
        slot = self.slots[index]
        assert slot.key is None and slot.pins == 0, (index, slot)
        self.slots[index] = Slot(key=key, pins=1, loading=True, prefetched=prefetched,
                                 last_use=slot.last_use)
        self._num_occupied += 1

    def commit(self, index: int) -> None:
        """The slot's bytes have fully arrived: publish it in the residency table."""
        slot = self.slots[index]
        assert slot.loading and slot.key is not None
        slot.loading = False
        self._set_map(slot.key, index)

    def clear(self, index: int) -> ExpertKey:
        """Evict a resident slot or abort a failed load; returns the key it held."""
        slot = self.slots[index]
        assert slot.key is not None and (slot.pins == 0 or slot.loading), (index, slot)
        key = slot.key
        if not slot.loading:
            self._set_map(key, NOT_RESIDENT)
        self.slots[index] = Slot(last_use=slot.last_use)   # a reload must still wait for it
        self._num_occupied -= 1
        return key

    def _set_map(self, key: ExpertKey, index: int) -> None:
        self._slot_of_host[key[0]][key[1]] = index
        self.slot_of[key[0], key[1]] = index
        if self._map_changes is not None:
            self._map_changes.add(key)

    def take_map_changes(self) -> set[ExpertKey] | None:
        """The keys whose slot changed since the last call (None: every key may have)."""
        changes, self._map_changes = self._map_changes, set()
        return changes

    def lease_map(self, keys_and_slots: list[tuple[ExpertKey, int]]) -> torch.Tensor:
        """`[E]` int32 map holding only these experts (of one layer): what one wave reads."""
        table = np.full(self.num_experts, NOT_RESIDENT, dtype=np.int32)
        for (_, expert), index in keys_and_slots:
            table[expert] = index
        return torch.from_numpy(table).to(self.device, non_blocking=True)

    def grow(self) -> None:
        """Enlarge to the target size, every expert staying in its slot (no load in flight:
        a load writes into the tensors it saw when it started)."""
        assert not any(s.loading for s in self.slots) and self.target_slots > self.num_slots
        if self._mapped is not None:
            self.slots += [Slot() for _ in range(self.target_slots - self.num_slots)]
            return
        old_parts, old_slots = self._parts(), self.slots
        self._allocate(self.target_slots)
        for new, old in zip(self._parts(), old_parts):
            new[:len(old_slots)].copy_(old)
        self.slots[:len(old_slots)] = old_slots
        self._num_occupied = sum(s.key is not None for s in old_slots)

    def compact(self, keep: list[int]) -> None:
        """Shrink to the target size holding the slots `keep` (quiet pool only). Mapped: the
        kept experts above the target move into free slots below it, and the tail's pages go
        back. Otherwise: one gather per tensor into new, smaller tensors."""
        assert self.is_quiet and len(keep) <= self.target_slots
        old_slots, size = self.slots, self.target_slots
        if self._mapped is not None:
            kept = set(keep)
            holes = iter(i for i in range(size) if i not in kept)
            moves = [(old, next(holes)) for old in keep if old >= size]
            placed = {old: old for old in keep if old < size} | dict(moves)
            for old, new in moves:
                for part in self._parts():
                    part[new].copy_(part[old])
            for m in self._mapped:
                m.release_rows(size, len(old_slots))
            self.slots = [Slot() for _ in range(size)]
        else:
            old_parts = self._parts()
            self._allocate(size)
            rows = torch.tensor(keep, dtype=torch.long, device=self.device)
            for new, old in zip(self._parts(), old_parts):
                torch.index_select(old, 0, rows, out=new[:len(keep)])
            placed = {old: new for new, old in enumerate(keep)}
        self._slot_of_host = [[NOT_RESIDENT] * self.num_experts for _ in range(self.num_layers)]
        for old, new in placed.items():
            slot = old_slots[old]
            self.slots[new] = Slot(key=slot.key, prefetched=slot.prefetched)
            self._slot_of_host[slot.key[0]][slot.key[1]] = new
        self.slot_of.copy_(torch.tensor(self._slot_of_host, dtype=torch.int32))
        self._num_occupied = len(keep)
        self._map_changes = None

    def check_integrity(self) -> None:
        assert self.holds >= 0
        seen: dict[ExpertKey, int] = {}
        for index, slot in enumerate(self.slots):
            assert slot.pins >= 0
            if slot.key is None:
                assert slot.pins == 0 and not slot.loading, (index, slot)
                continue
            assert slot.key not in seen, f"{slot.key} in slots {seen[slot.key]} and {index}"
            seen[slot.key] = index
            expected = NOT_RESIDENT if slot.loading else index
            assert self.lookup(slot.key) == expected, (slot.key, self.lookup(slot.key), index)
        assert self._num_occupied == sum(s.key is not None for s in self.slots)
        mapped = sum(i != NOT_RESIDENT for row in self._slot_of_host for i in row)
        assert mapped == sum(s.key is not None and not s.loading for s in self.slots)
        assert self.slot_of.cpu().tolist() == self._slot_of_host, "device table out of sync"

