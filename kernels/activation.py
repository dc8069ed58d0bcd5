"""The gated activation between an expert's two GEMMs: `act = f(gate, up)` over the gate and
up halves of `x @ w13.T` (plus `b13` where experts have biases).

- "silu": SiLU(gate) * up (Mixtral, Qwen, OLMoE, DeepSeek, GLM).
- "clamped_swiglu" (GPT-OSS): gate clamped above at `limit`, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SILU, CLAMPED_SWIGLU = "silu", "clamped_swiglu"
ACTIVATIONS = (SILU, CLAMPED_SWIGLU)
# GPT-OSS's published values, the defaults where a config omits them.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Activation:
    kind: str = SILU
    alpha: float = SWIGLU_ALPHA
    limit: float = SWIGLU_LIMIT

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.kind!r}; choose from {ACTIVATIONS}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up `[..., I]` -> `[..., I]`."""
        if self.kind == SILU:
            return F.silu(gate).mul_(up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
