"""Rotary position embeddings as `RopeSpec` configures them: plain or YaRN-scaled frequencies,
all or the leading `rotary_dim` dims of each head, rotated as halves (Llama) or as interleaved
pairs (DeepSeek).

Legend: T tokens, h heads, d head dims, r rotary dims, P table positions.
"""

from __future__ import annotations

import math

import torch

from mox.loaders.rope import ROPE_YARN, RopeSpec, rope_scale


def inverse_frequencies(rope: RopeSpec) -> torch.Tensor:
    """`[r/2]` f32, computed as transformers does (bit for bit: the tests compare logits)."""
    dim = rope.rotary_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.scaling != ROPE_YARN:
        return 1.0 / pos_freqs
    low, high = _yarn_correction_range(rope)
    if low == high:
        high += 0.001                     # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp              # 1: keep the original frequency; 0: interpolate
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs) * extrapolation


def _yarn_correction_range(rope: RopeSpec) -> tuple[float, float]:
    """The dims whose wavelengths lie between `beta_fast` and `beta_slow` rotations over the
    original context: below it frequencies are kept, above it divided by `factor`."""
    def dim_of(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return (rope.rotary_dim * math.log(turns)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope.rotary_dim - 1)


class Rotary:
    """cos/sin tables for positions [0, P), grown on demand, and the rotation itself."""

    def __init__(self, rope: RopeSpec, device: torch.device) -> None:
        self.rope = rope
        self.inv_freq = inverse_frequencies(rope).to(device)                # [r/2]
        self.scale = rope_scale(rope)
        self.cos = self.sin = torch.empty(0, rope.rotary_dim, device=device)

    def _grow(self, num_positions: int) -> None:
        size = max(num_positions, 2 * self.cos.shape[0], 256)
        pos = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                             # [P, r]
        self.cos, self.sin = emb.cos() * self.scale, emb.sin() * self.scale

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def reserve(self, num_positions: int) -> None:
        """Tables for at least positions [0, num_positions) (a CUDA graph reads them where
        they are: they grow before a capture, never inside one)."""
        if num_positions > self.cos.shape[0]:
            self._grow(num_positions)

    def tables(self, positions: torch.Tensor,
               max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, r]` for token positions `[T]` (all below `max_position`); a
        batch computes them once and every layer reuses them."""
        self.reserve(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, q: torch.Tensor, k: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q `[T, h, d]` and k `[T, h_kv, d]` by their tokens' `tables`."""
        return self.rotate(q, tables), self.rotate(k, tables)

    def rotate(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = tables
        dim = self.rope.rotary_dim
        x32 = x.float()
        x_rot = x32[..., :dim]
        if self.rope.interleaved:
            # pairs (x0, x1), (x2, x3), ...; the result lists the rotated evens, then odds,
            # as the reference does: q and k share the permutation, so q.k is unchanged
            half = dim // 2
            cos, sin = cos[..., :half], sin[..., :half]
            evens, odds = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.cat((evens * cos - odds * sin, odds * cos + evens * sin), dim=-1)
        else:
            half = dim // 2
            swapped = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
            rotated = x_rot * cos + swapped * sin
        if dim < x.shape[-1]:
            rotated = torch.cat((rotated, x32[..., dim:]), dim=-1)
        return rotated.to(x.dtype)
