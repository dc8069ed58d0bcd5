"""MoE compute kernels, imported as `mox.kernels`. Math only: nothing from the rest of mox.

    fused_moe(x[T,H], w13[S,2I,H], w2[S,H,I], topk_weights[T,k] f32, topk_ids[T,k] int32,
              slot_of[E] int32, activation="silu", backend="auto",
              b13[S,2I]=None, b2[S,H]=None, swiglu_alpha=1.702, swiglu_limit=7.0) -> [T,H]

`w13` holds gate rows then up rows. Experts are read through `slot_of` (logical expert ->
slot, or NOT_RESIDENT); a token routed to a non-resident expert gets nothing from it.
`activation`: "silu" or "clamped_swiglu" (GPT-OSS, with `swiglu_alpha`, `swiglu_limit`);
`b13`, `b2`: per-slot expert biases (GPT-OSS). `scales`: w13 and w2 stored quantized (int8,
int4, FP8; `mox.kernels.quant`). The Triton path runs "silu" without biases; `backend="auto"`
takes the torch path for the rest, `backend="triton"` refuses it.
"""

from __future__ import annotations

import torch

from .activation import ACTIVATIONS, CLAMPED_SWIGLU, SILU, SWIGLU_ALPHA, SWIGLU_LIMIT, Activation
from .moe_config import MoEKernelConfig, get_config
from .moe_reference import reference_fused_moe
from .moe_torch import NOT_RESIDENT, MoEWorkspace, fused_moe_torch
from .moe_triton import (
    ExpertRows,
    MappedExpert,
    expert_rows,
    fused_moe_triton,
    is_interpreter,
    rows_aligned,
)
from .quant import ExpertScales, WeightFormat, dequantize, quantize
from .routing import (
    sigmoid_grouped_topk,
    softmax_group_limited_topk,
    softmax_topk,
    topk_softmax,
)

BACKENDS = ("auto", "torch", "triton")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, slot_of: torch.Tensor,
              activation: str = "silu", backend: str = "auto",
              workspace: MoEWorkspace | None = None,
              out_dtype: torch.dtype | None = None, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, swiglu_alpha: float = SWIGLU_ALPHA,
              swiglu_limit: float = SWIGLU_LIMIT,
              scales: ExpertScales | None = None, rows: ExpertRows | None = None
              ) -> torch.Tensor:
    """`workspace` (torch path only) keeps buffers across calls; pass one per caller.
    `rows` (Triton path only): the row space `slot_of` indexes, with experts read in place
    past the pools' slots (`expert_rows`).
    `out_dtype` (default x's): float32 returns the sum before rounding (the torch path; the
    Triton path rounds to x's dtype in its epilogue, then converts). `scales`: w13 and w2
    are stored quantized (mox.kernels.quant)."""
    num_tokens, hidden = x.shape
    num_slots, two_inter = w13.shape[:2]
    stored = scales.fmt.stored_shape if scales is not None else lambda rows, cols: (rows, cols)
    assert w13.shape == (num_slots, *stored(two_inter, hidden)), w13.shape
    assert w2.shape == (num_slots, *stored(hidden, two_inter // 2)), w2.shape
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert topk_ids.dtype == torch.int32 and slot_of.dtype == torch.int32
    assert topk_weights.dtype == torch.float32
    act = Activation(activation, swiglu_alpha, swiglu_limit)
    assert (b13 is None) == (b2 is None), "expert biases come in pairs"
    assert b13 is None or (b13.shape == (num_slots, two_inter) and b2.shape == (num_slots, hidden))
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose from {BACKENDS}")
    triton_can = activation == SILU and b13 is None
    if rows is not None and rows.mapped and not (backend == "triton" or (
            backend == "auto" and x.is_cuda and triton_can)):
        raise ValueError("experts mapped past the pools' slots are read by the Triton path "
                         "only (a GPU, or backend='triton')")
    if backend == "triton" and not triton_can:
        raise ValueError(f"the Triton MoE path runs activation 'silu' without expert biases; "
                         f"got {activation!r}{' with biases' if b13 is not None else ''}: "
                         f"use backend='torch' (or 'auto')")
    if backend == "triton" or (backend == "auto" and x.is_cuda and triton_can):
        out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, slot_of, scales=scales,
                               rows=rows)
        return out if out_dtype is None else out.to(out_dtype)
    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, slot_of, workspace, out_dtype,
                           act, b13, b2, scales)


__all__ = ["ACTIVATIONS", "CLAMPED_SWIGLU", "NOT_RESIDENT", "SILU", "Activation", "dequantize",
           "expert_rows", "ExpertRows", "ExpertScales", "fused_moe", "fused_moe_torch",
           "fused_moe_triton", "get_config", "is_interpreter", "MappedExpert", "MoEKernelConfig",
           "MoEWorkspace", "quantize", "reference_fused_moe", "rows_aligned",
           "sigmoid_grouped_topk", "softmax_group_limited_topk", "softmax_topk", "topk_softmax",
           "WeightFormat"]
