"""The MoE block: router -> top-k -> fused grouped GEMM over the slot pool, plus the optional
sigmoid-gated shared expert (qwen2_moe).

Legend: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mox.kernels import fused_moe, softmax_topk
from mox.loaders.spec import ModelSpec
from mox.models.experts import ExpertPool
from mox.models.layers import MLPWeights


@dataclass
class MoEWeights:
    router: torch.Tensor                          # [E, H]
    moe_layer: int                                # row of this layer in the pool's slot map
    shared_expert: MLPWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]


def moe_block(spec: ModelSpec, w: MoEWeights, pool: ExpertPool, x: torch.Tensor) -> torch.Tensor:
    """x `[T, H]` -> `[T, H]`."""
    logits = F.linear(x, w.router)                                        # [T, E]
    topk_weights, topk_ids = softmax_topk(logits, spec.top_k, spec.norm_topk_prob)  # [T, k]
    out = fused_moe(x, pool.w13, pool.w2, topk_weights, topk_ids, pool.slot_map(w.moe_layer),
                    backend="auto", workspace=pool.workspace)
    if w.shared_expert is not None:
        gate = torch.sigmoid(F.linear(x, w.shared_expert_gate))          # [T, 1]
        out = out + gate * w.shared_expert(x)
    return out
