"""Small stateless building blocks of the decoder: RMSNorm, RoPE, SwiGLU MLP.

Legend: T tokens, H hidden, h heads, d head_dim, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 (bf16 squares overflow precision), scale in the input dtype, as HF."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Rotary:
    """RoPE tables for positions [0, max_positions), grown on demand."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                      device=device) / head_dim))
        self.cos = self.sin = torch.empty(0, head_dim, device=device)

    def _grow(self, num_positions: int) -> None:
        size = max(num_positions, 2 * self.cos.shape[0], 256)
        pos = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)            # [P, d]
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor,
               max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, d]` for token positions `[T]` (all below `max_position`); a
        batch computes them once and every layer reuses them."""
        if max_position >= self.cos.shape[0]:
            self._grow(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, h, d]` and k `[T, h_kv, d]` by their tokens' `tables`."""
        cos, sin = tables
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP: gate and up `[I, H]`, down `[H, I]`."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)
