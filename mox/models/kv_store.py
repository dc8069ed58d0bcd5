"""One model's paged KV storage: per layer, keys and values `[N, B, h_kv, d]` of N blocks of B
token slots; a flat slot index `block * B + offset` addresses one token's K/V. The storage
grows by doubling and is dropped when the model holds no blocks (its KV memory returns).

Which blocks are in use is the engine's KV pool's business; this is bytes only.

Legend: L layers, N blocks, B block size, h_kv KV heads, d head_dim, T new tokens, K keys.
"""

from __future__ import annotations

import torch


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.keys: list[torch.Tensor] = []          # per layer [N, B, h_kv, d]
        self.values: list[torch.Tensor] = []

    @property
    def block_nbytes(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)

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
        shape = (size, self.block_size, self.num_kv_heads, self.head_dim)

        def grown(layer: int, store: list[torch.Tensor]) -> torch.Tensor:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            if old:
                tensor[:old] = store[layer]
            return tensor

        self.keys = [grown(i, self.keys) for i in range(self.num_layers)]
        self.values = [grown(i, self.values) for i in range(self.num_layers)]

    def release(self) -> None:
        self.keys, self.values = [], []

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k, v `[T, h_kv, d]` at flat `slots` `[T]`."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.keys[layer].view(flat).index_copy_(0, slots, k)
        self.values[layer].view(flat).index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[K, h_kv, d]` at flat `slots` `[K]`."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        return (self.keys[layer].view(flat).index_select(0, slots),
                self.values[layer].view(flat).index_select(0, slots))
