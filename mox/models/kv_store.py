"""One model's paged KV storage: per layer, keys `[N, B, h_kv, d]` and values
`[N, B, h_kv, dv]` of N blocks of B token slots; a flat slot index `block * B + offset`
addresses one token's K/V. The storage grows by doubling and is dropped when the model holds
no blocks (its KV memory returns). MLA models store their compressed latent as the "key"
(h_kv = 1, d = kv_lora_rank) and the rotated shared key as the "value" (dv = qk_rope_head_dim).

Which blocks are in use is the engine's KV pool's business; this is bytes only.

Legend: L layers, N blocks, B block size, h_kv KV heads, d key dim, dv value dim,
T new tokens, K keys.
"""

from __future__ import annotations

import torch


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, value_dim: int | None = None) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.keys: list[torch.Tensor] = []          # per layer [N, B, h_kv, d]
        self.values: list[torch.Tensor] = []

    @property
    def block_nbytes(self) -> int:
        return (self.num_layers * self.block_size * self.num_kv_heads
                * (self.head_dim + self.value_dim) * self.dtype.itemsize)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def ensure_blocks(self, num_blocks: int, max_blocks: int | None = None) -> None:
        """At least `num_blocks` blocks: doubling (amortised copies), but never past
        `max_blocks` (the pool's budget) unless `num_blocks` itself is."""
        if num_blocks <= self.num_blocks:
            return
        old = self.num_blocks
        size = max(num_blocks, min(2 * old, max_blocks or 2 * old))
        def grown(layer: int, store: list[torch.Tensor], dim: int) -> torch.Tensor:
            tensor = torch.empty(size, self.block_size, self.num_kv_heads, dim,
                                 dtype=self.dtype, device=self.device)
            if old:
                tensor[:old] = store[layer]
            return tensor

        self.keys = [grown(i, self.keys, self.head_dim) for i in range(self.num_layers)]
        self.values = [grown(i, self.values, self.value_dim) for i in range(self.num_layers)]

    def release(self) -> None:
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

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[K, h_kv, d]` and values `[K, h_kv, dv]` at flat `slots` `[K]`."""
        keys, values = self.rows(layer)
        return keys.index_select(0, slots), values.index_select(0, slots)
