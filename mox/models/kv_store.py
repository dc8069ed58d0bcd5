"""One model's paged KV storage: per layer, keys `[N, B, h_kv, d]` and values
`[N, B, h_kv, dv]` of N blocks of B token slots; a flat slot index `block * B + offset`
addresses one token's K/V. The storage grows by doubling and is dropped when the model holds
no blocks (its KV memory returns). MLA models store their compressed latent as the "key"
(h_kv = 1, d = kv_lora_rank) and the rotated shared key as the "value" (dv = qk_rope_head_dim).

On the CPU the tensors are views of anonymous mappings sized for the pool's budget
(mox.pager.mapped, as the expert slot pools): growing takes a longer view, with no copy and
no second allocation, and only the pages written are backed; releasing hands the pages back
and keeps the address range. Doubling by copy had held a 32-sequence bench decode for 21-33
ms each time the store grew from 256 blocks to 512 (a step's own time is ~40 ms).

Which blocks are in use is the engine's KV pool's business; this is bytes only.

Legend: L layers, N blocks, B block size, h_kv KV heads, d key dim, dv value dim,
T new tokens, K keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mox.pager.mapped import MappedTensor


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, value_dim: int | None = None) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.keys: list[torch.Tensor] = []          # per layer [N, B, h_kv, d]
        self.values: list[torch.Tensor] = []
        self._mapped_keys: list[MappedTensor] = []  # (CPU) what keys and values view
        self._mapped_values: list[MappedTensor] = []

    @property
    def block_nbytes(self) -> int:
        return (self.num_layers * self.block_size * self.num_kv_heads
                * (self.head_dim + self.value_dim) * self.dtype.itemsize)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def ensure_blocks(self, num_blocks: int, max_blocks: int | None = None) -> None:
        """At least `num_blocks` blocks: doubling (amortised copies), but never past
        `max_blocks` (the pool's budget) unless `num_blocks` itself is. On the CPU, a view
        of the mapping (reserved for `max_blocks` at first) that is `size` blocks long."""
        if num_blocks <= self.num_blocks:
            return
        old = self.num_blocks
        size = max(num_blocks, min(2 * old, max_blocks or 2 * old))
        if self.device.type == "cpu":
            self._map(size, max(size, max_blocks or 0))
            self.keys = [m.tensor[:size] for m in self._mapped_keys]
            self.values = [m.tensor[:size] for m in self._mapped_values]
            return

        def grown(layer: int, store: list[torch.Tensor], dim: int) -> torch.Tensor:
            tensor = torch.empty(size, self.block_size, self.num_kv_heads, dim,
                                 dtype=self.dtype, device=self.device)
            if old:
                tensor[:old] = store[layer]
            return tensor

        self.keys = [grown(i, self.keys, self.head_dim) for i in range(self.num_layers)]
        self.values = [grown(i, self.values, self.value_dim) for i in range(self.num_layers)]

    def _map(self, size: int, capacity: int) -> None:
        """Mappings of at least `size` blocks (new ones of `capacity` blocks, the blocks in
        use copied over, where the budget grew past the old ones)."""
        if self._mapped_keys and self._mapped_keys[0].tensor.shape[0] >= size:
            return
        old = self.num_blocks

        def mapped(layer: int, store: list[torch.Tensor], dim: int) -> MappedTensor:
            m = MappedTensor((capacity, self.block_size, self.num_kv_heads, dim), self.dtype)
            if old:
                m.tensor[:old] = store[layer]
            return m

        self._mapped_keys = [mapped(i, self.keys, self.head_dim)
                             for i in range(self.num_layers)]
        self._mapped_values = [mapped(i, self.values, self.value_dim)
                               for i in range(self.num_layers)]

    def release(self) -> None:
        for m in (*self._mapped_keys, *self._mapped_values):
            m.release()
        self.keys, self.values = [], []

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys `[N, h_kv, d]` and values `[N, h_kv, dv]` by flat slot (views)."""
        return (self.keys[layer].view(-1, self.num_kv_heads, self.head_dim),
                self.values[layer].view(-1, self.num_kv_heads, self.value_dim))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k `[T, h_kv, d]`, v `[T, h_kv, dv]` at flat `slots` `[T]`."""
        keys, values = self.rows(layer)
        keys.index_copy_(0, slots, k)
        values.index_copy_(0, slots, v)

    def anchor(self) -> KVAnchor:
        """Fixed tensors laid out as one slot of this store's keys and values, and the
        offsets from them to each layer's rows (`KVAnchor.follow` sets them)."""
        device = self.device
        return KVAnchor(
            torch.empty(1, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=device),
            torch.empty(1, self.num_kv_heads, self.value_dim, dtype=self.dtype, device=device),
            torch.zeros(self.num_layers, 2, dtype=torch.int64, device=device))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[K, h_kv, d]` and values `[K, h_kv, dv]` at flat `slots` `[K]`."""
        keys, values = self.rows(layer)
        return keys.index_select(0, slots), values.index_select(0, slots)


@dataclass(frozen=True)
class KVAnchor:
    """A KV store addressed from anchors that never move (a CUDA graph bakes every address it
    reads; the store grows and is released and allocated again): the Triton kernels read
    layer l's rows `offsets[l]` elements past the anchors (mox.models.decode_graphs)."""

    keys: torch.Tensor              # [1, h_kv, d]
    values: torch.Tensor            # [1, h_kv, dv]
    offsets: torch.Tensor           # [L, 2] int64: to each layer's keys, values
    _followed: list[int] = field(default_factory=list)   # the store's addresses they point at

    def follow(self, store: KVStore) -> None:
        """Point the offsets at the store's rows as they are now (a copy to the device only
        when the store moved)."""
        where = [t.data_ptr() for t in (*store.keys, *store.values)]
        if where == self._followed:
            return
        self._followed[:] = where
        size = self.keys.element_size()
        deltas = []
        for keys, values in zip(store.keys, store.values):
            delta = (keys.data_ptr() - self.keys.data_ptr(), values.data_ptr()
                     - self.values.data_ptr())
            # (the kernels assume 16-element multiples, to keep vector loads: allocations
            # are 512-byte aligned on a GPU, 64-byte or page aligned on a CPU)
            assert delta[0] % (16 * size) == 0 and delta[1] % (16 * size) == 0, \
                "KV store or anchor not aligned to 16 elements"
            deltas.append((delta[0] // size, delta[1] // size))
        self.offsets.copy_(torch.tensor(deltas, dtype=torch.int64))
