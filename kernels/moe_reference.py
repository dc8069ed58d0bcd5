"""The plain definition of a fused MoE call, token by token in fp32: what every backend
(torch, native, Triton; bf16 or quantized pools, the latter through their dequantized
values) is tested against."""

from __future__ import annotations

import torch

from .activation import SILU, Activation

NOT_RESIDENT = -1
SILU_ACTIVATION = Activation(SILU)


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        slot_of: torch.Tensor, activation: Activation = SILU_ACTIVATION,
                        b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None) -> torch.Tensor:
    """The plain definition, token by token, in fp32: what every backend must equal."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            slot = int(slot_of[int(topk_ids[t, j])])
            if slot == NOT_RESIDENT:
                continue
            gate_up = w13[slot].float() @ x[t].float()
            if b13 is not None:
                gate_up = gate_up + b13[slot].float()
            down = w2[slot].float() @ activation(gate_up[:inter], gate_up[inter:])
            if b2 is not None:
                down = down + b2[slot].float()
            out[t] += topk_weights[t, j].float() * down
    return out.to(x.dtype)
