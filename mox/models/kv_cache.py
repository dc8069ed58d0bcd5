"""A contiguous KV cache for one sequence (the engine replaces it with the shared paged pool).

Legend: L layers, P positions, h_kv KV heads, d head_dim.
"""

from __future__ import annotations

import torch

INITIAL_POSITIONS = 64  # grows by doubling, so a long generation reallocates O(log P) times


class SequenceKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, INITIAL_POSITIONS, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)     # [L, P, h_kv, d]
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.num_tokens = 0     # positions [0, num_tokens) hold valid K/V in every layer

    def _reserve(self, num_positions: int) -> None:
        capacity = self.keys.shape[1]
        if num_positions <= capacity:
            return
        new_capacity = max(num_positions, 2 * capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], new_capacity, *old.shape[2:]))
            new[:, :capacity] = old
            setattr(self, name, new)

    def write(self, layer: int, start: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v `[T, h_kv, d]` at positions [start, start+T); return all keys and values
        `[start+T, h_kv, d]` of that layer."""
        end = start + k.shape[0]
        self._reserve(end)
        self.keys[layer, start:end] = k
        self.values[layer, start:end] = v
        return self.keys[layer, :end], self.values[layer, :end]
