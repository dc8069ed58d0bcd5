"""Small stateless building blocks of the decoder: RMSNorm, SwiGLU MLP.

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except one bf16 row on the CPU (batch-1 decode), where torch.mv streams the
    weight faster than the GEMM F.linear dispatches to (measured here, 2 threads: 32000x512
    1.3 vs 2.2 ms, 1024x1024 86 vs 134 us)."""
    if x.shape[0] != 1 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    out = torch.mv(weight, x[0])[None]
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 (bf16 squares overflow precision), scale in the input dtype, as HF."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP: gate and up `[I, H]`, down `[H, I]`."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
