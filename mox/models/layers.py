"""Small stateless building blocks of the decoder: RMSNorm, SwiGLU MLP.

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mox.kernels import native, triton_ops


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except a few bf16 rows on the CPU (decode), where the native kernel reads
    the weight at the machine's full rate, about twice what torch's GEMMs reach for that
    shape (bench/results/read_rate.md)."""
    if not native.takes(x, weight):
        return F.linear(x, weight, bias)
    out = native.gemv_bf16(x, weight)
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 (bf16 squares overflow precision), scale in the input dtype, as HF
    (bf16 rows on a CPU: in one native call, not seven small ops; on a GPU one Triton
    kernel)."""
    if native.takes_norm(x, weight):
        return native.kernels().rms_norm(x, weight, eps)
    if _triton_norm(x, weight):
        return triton_ops.rms_norm(x, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + y` and its `rms_norm` (on a GPU both in one Triton kernel)."""
    if _triton_norm(x, weight) and y.shape == x.shape and y.stride(1) == 1:
        return triton_ops.rms_norm(x, weight, eps, residual=y)
    summed = x + y
    return summed, rms_norm(summed, weight, eps)


def _triton_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (triton_ops.takes(x) and x.dim() == 2 and x.stride(1) == 1
            and x.dtype == weight.dtype)


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP: gate and up `[I, H]`, down `[H, I]`."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
