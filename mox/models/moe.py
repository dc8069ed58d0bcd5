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
from mox.models.experts import ModelExperts
from mox.models.layers import MLPWeights


@dataclass
class MoEWeights:
    router: torch.Tensor                          # [E, H]
    moe_layer: int                                # row of this layer in the pool's slot map
    shared_expert: MLPWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]


def route(spec: ModelSpec, router: torch.Tensor,
          x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> top-k weights `[T, k]` f32 and expert ids `[T, k]` int32."""
    return softmax_topk(F.linear(x, router), spec.top_k, spec.norm_topk_prob)


def moe_block(spec: ModelSpec, w: MoEWeights, experts: ModelExperts,
              x: torch.Tensor) -> torch.Tensor:
    """x `[T, H]` -> `[T, H]`. Experts come in waves from the pager: the resident ones first
    (computed while misses load), then the rest as they arrive; each wave's slot map holds
    only its experts, so every (token, expert) pair is computed exactly once."""
    topk_weights, topk_ids = route(spec, w.router, x)                     # [T, k]
    out = None
    for lease in experts.waves(w.moe_layer, topk_ids.unique().tolist()):
        # fp32 across waves, rounded once: the result does not depend on how many waves
        # residency split the step into (greedy output is the same cold or warm)
        part = fused_moe(x, lease.w13, lease.w2, topk_weights, topk_ids, lease.slot_map,
                         backend="auto", workspace=experts.workspace, out_dtype=torch.float32)
        out = part if out is None else out.add_(part)
    out = out.to(x.dtype)
    if w.shared_expert is not None:
        gate = torch.sigmoid(F.linear(x, w.shared_expert_gate))          # [T, 1]
        out = out + gate * w.shared_expert(x)
    return out
