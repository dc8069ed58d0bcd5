"""Fused MoE on CPU (and the fallback anywhere): one matmul per resident expert over a
contiguous block of its tokens, then a single scatter-add.

Legend: T tokens, k experts per token, E logical experts, S slots, H hidden, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NOT_RESIDENT = -1


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    slot_of: torch.Tensor) -> torch.Tensor:
    num_tokens, k = topk_ids.shape
    inter = w2.shape[2]
    slots = slot_of[topk_ids.long()].reshape(-1)                   # [T*k]
    order = torch.argsort(slots, stable=True)                      # [T*k] pairs grouped by slot
    sorted_slots = slots[order]
    token_of = order // k                                          # [T*k]
    weight_of = topk_weights.reshape(-1)[order]                    # [T*k] f32
    run_slots, run_lengths = torch.unique_consecutive(sorted_slots, return_counts=True)
    # fp32 accumulation: k bf16 contributions summed in bf16 lose ~3 bits each.
    contrib = torch.zeros(order.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for slot, length in zip(run_slots.tolist(), run_lengths.tolist()):
        end = start + length
        if slot != NOT_RESIDENT:
            rows = x[token_of[start:end]]                          # [n, H]
            gate_up = rows @ w13[slot].t()                         # [n, 2I]
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
            contrib[start:end] = (act @ w2[slot].t()).float() * weight_of[start:end, None]
        start = end
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, contrib)
    return out.to(x.dtype)


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        slot_of: torch.Tensor) -> torch.Tensor:
    """The plain definition, token by token, in fp32: what every backend must equal."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            slot = int(slot_of[int(topk_ids[t, j])])
            if slot == NOT_RESIDENT:
                continue
            gate_up = w13[slot].float() @ x[t].float()
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += topk_weights[t, j].float() * (w2[slot].float() @ act)
    return out.to(x.dtype)
