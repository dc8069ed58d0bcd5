"""Router math: gate logits -> (top-k weights, top-k expert ids).

Shapes: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE / OLMoE routing: softmax over all E, keep the k largest, optionally
    rescale them to sum to 1. Returns weights `[T, k]` float32 and ids `[T, k]` int32."""
    assert logits.dim() == 2 and 0 < k <= logits.shape[1], (logits.shape, k)
    probs = torch.softmax(logits.float(), dim=-1)           # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)             # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
