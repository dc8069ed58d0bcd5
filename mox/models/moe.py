"""The MoE block: router -> top-k -> fused grouped GEMM over the slot pool, plus the optional
shared expert (sigmoid-gated in qwen2_moe, plainly added in DeepSeek and GLM4-MoE).

Legend: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass

import torch

from mox.kernels import (
    Activation,
    ExpertScales,
    fused_moe,
    native,
    sigmoid_grouped_topk,
    softmax_group_limited_topk,
    softmax_topk,
    topk_softmax,
    triton_ops,
)
from mox.kernels.native_moe import MoELayer, moe_layer
from mox.loaders.spec import (
    ROUTING_SIGMOID_GROUPED,
    ROUTING_SOFTMAX,
    ROUTING_SOFTMAX_GROUPED,
    ROUTING_TOPK_SOFTMAX,
    ModelSpec,
)
from mox.models.layers import MLPWeights, linear
from mox.pager import ModelPool, ReadsPending
from mox.pager.model_pool import Hold


@dataclass
class MoEWeights:
    router: torch.Tensor                          # [E, H] (f32 where `spec.router.fp32`)
    moe_layer: int                                # row of this layer in the pool's slot map
    router_bias: torch.Tensor | None = None       # [E]
    correction_bias: torch.Tensor | None = None   # [E] f32: steers the choice only
    shared_expert: MLPWeights | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]


def route(spec: ModelSpec, w: MoEWeights, x: torch.Tensor,
          mark: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, H]` -> top-k weights `[T, k]` f32 and expert ids `[T, k]` int32. `mark [E]`
    (int32): set to 1 where a token chose the expert."""
    router = spec.router
    if router.fp32:
        logits = linear(x.float(), w.router.float(), w.router_bias)         # [T, E]
    else:
        logits = linear(x, w.router, w.router_bias)
    if router.scoring == ROUTING_SOFTMAX and triton_ops.takes(logits):     # (one kernel)
        return triton_ops.softmax_topk(logits, spec.top_k, spec.norm_topk_prob,
                                       router.routed_scaling_factor, mark=mark)
    if (router.scoring == ROUTING_SIGMOID_GROUPED and triton_ops.takes(logits)
            and triton_ops.takes_sigmoid_grouped(spec.num_experts, router.n_group)):
        return triton_ops.sigmoid_grouped_topk(
            logits, spec.top_k, w.correction_bias, router.n_group, router.topk_group,
            spec.norm_topk_prob, router.routed_scaling_factor, mark=mark)
    weights, ids = _route_logits(spec, w, logits)
    if mark is not None:
        mark.index_fill_(0, ids.reshape(-1).long(), 1)
    return weights, ids


def _route_logits(spec: ModelSpec, w: MoEWeights,
                  logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` from the router's logits `[T, E]`."""
    router = spec.router
    native_routing = _native_routing(spec)
    if native_routing is not None and native.takes_routing(logits):
        return native.kernels().route(logits, spec.top_k, *native_routing)
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


def _native_routing(spec: ModelSpec) -> tuple[str, bool, float] | None:
    """The routing as the native kernels take it (scoring, renormalize, scaling), or None
    where they do not do it (grouped or sigmoid scores)."""
    router = spec.router
    if router.scoring == ROUTING_TOPK_SOFTMAX:            # (the weights sum to 1: no scaling)
        return "topk_softmax", False, 1.0
    if router.scoring == ROUTING_SOFTMAX:
        return "softmax_topk", spec.norm_topk_prob, router.routed_scaling_factor
    return None


def native_moe_layer(spec: ModelSpec, w: MoEWeights) -> MoELayer | None:
    """The layer's router as the native decode block takes it (csrc/moe_block.c: routing,
    residency and experts in one call), or None where its routing is one the block does not
    do (grouped or sigmoid scores, an fp32 router)."""
    routing = _native_routing(spec)
    if (routing is None or spec.router.fp32 or w.router.dtype != torch.bfloat16
            or w.router.device.type != "cpu"):
        return None
    return moe_layer(w.router, w.router_bias, spec.moe_intermediate_size, spec.top_k, *routing)


def takes_native(w: MoEWeights, experts: ModelPool, x: torch.Tensor) -> bool:
    """Whether the native block may serve these decode rows: the router's GEMV and the expert
    kernel's fast path serve them here, and no token's row count could exceed what the
    kernel beats torch at (every token routing to one expert)."""
    pool = experts.slot_pool
    scales = None if pool.fmt is None else ExpertScales(pool.fmt, pool.w13_scale, pool.w2_scale)
    return (native.takes(x, w.router)
            and x.shape[0] <= native.max_rows_per_expert()
            and native.takes_experts(x, pool.w13, pool.w2, scales, pool.b13, pool.b2))


def moe_block(spec: ModelSpec, w: MoEWeights, experts: ModelPool, h: torch.Tensor,
              x: torch.Tensor, native_layer: MoELayer | None = None
              ) -> Generator[ReadsPending, None, torch.Tensor]:
    """h `[T, H]` (the normed residual stream x `[T, H]`) -> x + block(h). With a
    `native_layer` (decode on a CPU, callers check `takes_native`), routing and the experts
    run in one native call when every expert the tokens route to is resident; otherwise, or
    without one, experts come in waves from the pager: the resident ones first (computed
    while misses load), then the rest as they arrive; each wave's slot map holds only its
    experts, so every (token, expert) pair is computed exactly once. Where a wave waits for
    reads, the block yields them to its driver (mox.pager.pending)."""
    if native_layer is not None:
        fold = w.shared_expert is None                       # the residual add in the call
        with experts.holding() as hold:
            topk_weights, topk_ids, out = native.kernels().moe_block(
                native_layer, h, hold.slot_of[w.moe_layer], hold.w13, hold.w2, hold.scales,
                activation(spec), hold.b13, hold.b2, residual=x if fold else None)
            if out is not None:
                hold.used.append((w.moe_layer, topk_ids.reshape(-1).tolist()))
        if out is not None:
            return out if fold else x + _add_shared(w, h, out)
    else:
        topk_weights, topk_ids = route(spec, w, h)                        # [T, k]
    return (yield from paged_experts(spec, w, experts, h, x, topk_weights, topk_ids))


def paged_experts(spec: ModelSpec, w: MoEWeights, experts: ModelPool, h: torch.Tensor,
                  x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                  ) -> Generator[ReadsPending, None, torch.Tensor]:
    """x + the block of h `[T, H]` routed as `topk_weights`, `topk_ids` `[T, k]`, its experts
    leased from the pager in waves (`moe_block`)."""
    out = None
    # (the pager takes each expert once: a host list is cheaper than a device unique())
    for lease in experts.wave_steps(w.moe_layer, topk_ids.reshape(-1).tolist()):
        if isinstance(lease, ReadsPending):
            yield lease
            continue
        # fp32 across waves, rounded once: the result does not depend on how many waves
        # residency split the step into (greedy output is the same cold or warm)
        # (experts mapped from host memory: the Triton kernels read them in place)
        backend = "triton" if lease.rows.mapped else "auto"
        part = fused_moe(h, lease.w13, lease.w2, topk_weights, topk_ids, lease.slot_map,
                         spec.activation, backend=backend, workspace=experts.workspace,
                         out_dtype=torch.float32, b13=lease.b13, b2=lease.b2,
                         swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit,
                         scales=lease.scales, rows=lease.rows)
        out = part if out is None else out.add_(part)
    return x + _add_shared(w, h, out.to(h.dtype))


def table_moe_block(spec: ModelSpec, w: MoEWeights, hold: Hold, h: torch.Tensor,
                    x: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """x + the block of h `[T, H]`, its experts read by the Triton kernels through the
    pager's expert table (`hold.table`, complete: each expert in a slot or mapped from the
    pinned host cache), so nothing asks the host; the experts it computes are marked in
    `used [L, E]` on the device (the pager reads it back when the hold ends)."""
    weights, ids = route(spec, w, h, mark=used[w.moe_layer])               # [T, k]
    table = hold.table
    # (one wave: the sum rounded once to h's dtype, as the waves' is)
    out = fused_moe(h, hold.w13, hold.w2, weights, ids, table.row_of[w.moe_layer],
                    spec.activation, backend="triton", scales=hold.scales, rows=table.rows)
    return x + _add_shared(w, h, out)


def activation(spec: ModelSpec) -> Activation:
    """The experts' activation as the native kernels take it."""
    return _activation(spec.activation, spec.swiglu_alpha, spec.swiglu_limit)


@functools.cache
def _activation(kind: str, alpha: float, limit: float) -> Activation:
    return Activation(kind, alpha, limit)          # (one per model: not built every layer)


def _add_shared(w: MoEWeights, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The routed experts' `out` plus the shared expert, where the layer has one."""
    if w.shared_expert is None:
        return out
    if w.shared_expert_gate is None:
        return out + w.shared_expert(h)
    gate = torch.sigmoid(linear(h, w.shared_expert_gate))              # [T, 1]
    return out + gate * w.shared_expert(h)
