"""The MoE block: router -> top-k -> fused grouped GEMM over the slot pool, plus the optional
shared expert (sigmoid-gated in qwen2_moe, plainly added in DeepSeek and GLM4-MoE).

Legend: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from mox.kernels import (
    fused_moe,
    sigmoid_grouped_topk,
    softmax_group_limited_topk,
    softmax_topk,
    topk_softmax,
)
from mox.loaders.spec import (
    ROUTING_SIGMOID_GROUPED,
    ROUTING_SOFTMAX,
    ROUTING_SOFTMAX_GROUPED,
    ROUTING_TOPK_SOFTMAX,
    ModelSpec,
)
from mox.models.layers import MLPWeights, linear
from mox.pager import ModelPool, ReadsPending


@dataclass
class MoEWeights:
    router: torch.Tensor                          # [E, H] (f32 where `spec.router.fp32`)
    moe_layer: int                                # row of this layer in the pool's slot map
    router_bias: torch.Tensor | None = None       # [E]
    correction_bias: torch.Tensor | None = None   # [E] f32: steers the choice only
    shared_expert: MLPWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]


def route(spec: ModelSpec, w: MoEWeights,
          x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> top-k weights `[T, k]` f32 and expert ids `[T, k]` int32."""
    router = spec.router
    if router.fp32:
        logits = linear(x.float(), w.router.float(), w.router_bias)         # [T, E]
    else:
        logits = linear(x, w.router, w.router_bias)
    if router.scoring == ROUTING_TOPK_SOFTMAX:
        return topk_softmax(logits, spec.top_k)
    if router.scoring == ROUTING_SIGMOID_GROUPED:
        return sigmoid_grouped_topk(logits, spec.top_k, w.correction_bias, router.n_group,
                                    router.topk_group, spec.norm_topk_prob,
                                    router.routed_scaling_factor)
    if router.scoring == ROUTING_SOFTMAX_GROUPED:
        weights, ids = softmax_group_limited_topk(logits, spec.top_k, router.n_group,
                                                  router.topk_group)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        assert router.scoring == ROUTING_SOFTMAX, router.scoring
        weights, ids = softmax_topk(logits, spec.top_k, spec.norm_topk_prob)
    if router.routed_scaling_factor != 1.0:
        weights = weights * router.routed_scaling_factor
    return weights, ids


def moe_block(spec: ModelSpec, w: MoEWeights, experts: ModelPool,
              x: torch.Tensor) -> Generator[ReadsPending, None, torch.Tensor]:
    """x `[T, H]` -> `[T, H]`. Experts come in waves from the pager: the resident ones first
    (computed while misses load), then the rest as they arrive; each wave's slot map holds
    only its experts, so every (token, expert) pair is computed exactly once. Where a wave
    waits for reads, the block yields them to its driver (mox.pager.pending)."""
    topk_weights, topk_ids = route(spec, w, x)                            # [T, k]
    out = None
    # (the pager takes each expert once: a host list is cheaper than a device unique())
    for lease in experts.wave_steps(w.moe_layer, topk_ids.reshape(-1).tolist()):
        if isinstance(lease, ReadsPending):
            yield lease
            continue
        # fp32 across waves, rounded once: the result does not depend on how many waves
        # residency split the step into (greedy output is the same cold or warm)
        part = fused_moe(x, lease.w13, lease.w2, topk_weights, topk_ids, lease.slot_map,
                         spec.activation, backend="auto", workspace=experts.workspace,
                         out_dtype=torch.float32, b13=lease.b13, b2=lease.b2,
                         swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit,
                         scales=lease.scales)
        out = part if out is None else out.add_(part)
    out = out.to(x.dtype)
    if w.shared_expert is None:
        return out
    if w.shared_expert_gate is None:
        return out + w.shared_expert(x)
    gate = torch.sigmoid(linear(x, w.shared_expert_gate))              # [T, 1]
    return out + gate * w.shared_expert(x)
