"""How a MoE layer is handed to the native kernels: its slot pools to csrc/moe_experts.c (the
formats it reads, the layout checks that keep the C code in bounds, the pool and gating
structs) and its router to csrc/moe_block.c (a struct built once per layer)."""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from .activation import SILU, Activation
from .quant import FP8, INT4, INT8, MXFP4, ExpertScales

K_MULTIPLE = 32         # the fast paths read 32 bf16 at a time
QUANT_BLOCK = 64        # quantized experts: activations share one int8 scale per 64 values
MXFP4_GROUP = 32        # MXFP4's scales: one per 32 values (the kernel takes no other)
C_KINDS = {INT8: 1, INT4: 2, MXFP4: 3, FP8: 4}      # moe_experts.c's weight kinds
SILU_GATE = Activation(SILU)
# moe_block.c's routings: softmax over every expert then the top k (Mixtral, Qwen, OLMoE), or
# the top k logits then their softmax (GPT-OSS)
SCORINGS = {"softmax_topk": 0, "topk_softmax": 1}


def check_experts(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  scratch: list[torch.Tensor], scales: ExpertScales | None,
                  row_weights: torch.Tensor, checked: list) -> None:
    """What `moe_experts` hands the C code must be laid out as it reads it: a mismatch would
    read or write out of bounds, so it raises here. `checked`: the pools last found good, as
    [(w13, w2, scales, hidden)] (weak references: the cache keeps no pool alive): a decode
    step hands the same pools to every call, so they are checked once (the rows and scratch
    every time)."""
    (num_rows, hidden), inter = rows.shape, w13.shape[1] // 2
    if [t.dtype for t in scratch] != [torch.float32, torch.bfloat16, torch.float32] or (
            row_weights.numel() != num_rows or rows.dtype != torch.bfloat16):
        raise ValueError("moe_experts takes bf16 rows, and its row weights and scratch must "
                         "match them")
    for t in (rows, *scratch):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError("moe_experts takes tensors contiguous per slot and per row")
    if [t.shape for t in scratch] != [(num_rows, 2 * inter), (num_rows, inter),
                                       (num_rows, hidden)]:
        raise ValueError("moe_experts' scratch and pools disagree with its rows")
    check_pools(w13, w2, scales, hidden, inter, checked)


def check_pools(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None,
                hidden: int, inter: int, checked: list) -> None:
    """The pools' part of `check_experts`, with its cache."""
    pools = (w13, w2, scales)
    last = checked[0] if checked else None
    if last is None or last[3] != (hidden, inter) or any(
            (ref is None and pool is not None) or (ref is not None and ref() is not pool)
            for ref, pool in zip(last[:3], pools)):
        _check_pools(w13, w2, scales, hidden, inter)
        checked[:] = [(*(None if t is None else weakref.ref(t) for t in pools),
                       (hidden, inter))]


def _check_pools(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None,
                 hidden: int, inter: int) -> None:
    slots = {w13.shape[0], w2.shape[0]} | (
        set() if scales is None else {scales.w13.shape[0], scales.w2.shape[0]})
    if len(slots) != 1:
        raise ValueError("moe_experts' pools and scales disagree")
    for t in (w13, w2):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError("moe_experts takes tensors contiguous per slot and per row")
    stored = (lambda r, c: (r, c)) if scales is None else scales.fmt.stored_shape
    if w13.shape[1:] != stored(2 * inter, hidden) or w2.shape[1:] != stored(hidden, inter):
        raise ValueError(f"the experts' pools are not of hidden size {hidden} and "
                         f"intermediate size {inter}")
    weight_dtype = torch.bfloat16 if scales is None else scales.fmt.storage_dtype
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype or not native_format(scales):
        raise ValueError(f"moe_experts takes bf16 rows and bf16, int8 per channel, int4 or "
                         f"MXFP4 group-wise or FP8 block-wise weights, got {w13.dtype}")
    if scales is not None and (
            scales.w13.shape[1:] != (2, *scales.fmt.scale_shape(inter, hidden))
            or scales.w2.shape[1:] != scales.fmt.scale_shape(hidden, inter)
            or scales.w13.dtype != torch.float32 or scales.w2.dtype != torch.float32
            or not (scales.w13[0].is_contiguous() and scales.w2[0].is_contiguous())):
        raise ValueError("moe_experts takes float32 scales of the format's shape, contiguous "
                         "per slot")


class _Gating(ctypes.Structure):
    """moe_experts.c's gating_t: biases and the activation between an expert's GEMMs."""

    _fields_ = [("b13", ctypes.c_void_p), ("b13_stride", ctypes.c_int64),
                ("b2", ctypes.c_void_p), ("b2_stride", ctypes.c_int64),
                ("clamped", ctypes.c_int), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float)]


def gating(activation: Activation, b13: torch.Tensor | None, b2: torch.Tensor | None,
           num_slots: int, hidden: int, inter: int):
    """A pointer to the C struct for these biases and activation, which it keeps alive
    (None: SiLU without biases)."""
    if b13 is None and b2 is None and activation.kind == SILU:
        return None
    for bias, width in ((b13, 2 * inter), (b2, hidden)):
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.stride(-1) != 1
                                 or tuple(bias.shape) != (num_slots, width)):
            raise ValueError(f"moe_experts takes bf16 biases [{num_slots}, {width}]")
    def pointer(bias):
        return (None, 0) if bias is None else (bias.data_ptr(), bias.stride(0))
    return ctypes.byref(_Gating(*pointer(b13), *pointer(b2), int(activation.kind != SILU),
                                activation.alpha, activation.limit))


def native_format(scales: ExpertScales | None) -> bool:
    """bf16 (no scales), int8 per output row, int4 in groups of 32 or a multiple of QUANT_BLOCK,
    MXFP4 (groups of 32), or FP8 in any blocks of a multiple of K_MULTIPLE inputs."""
    if scales is None:
        return True
    fmt = scales.fmt
    if fmt.kind == FP8:
        return fmt.block_cols % K_MULTIPLE == 0
    return fmt.block_rows == 1 and (
        (fmt.kind == INT8 and fmt.block_cols == 0)
        or (fmt.kind == INT4 and fmt.block_cols > 0
            and (fmt.block_cols % QUANT_BLOCK == 0 or fmt.block_cols == 32))
        or (fmt.kind == MXFP4 and fmt.block_cols == MXFP4_GROUP))


class PoolStruct(ctypes.Structure):
    """moe_pools.h's pool_t: one part's slots (w13 or w2) and their scales."""

    _fields_ = [("w", ctypes.c_void_p), ("stride", ctypes.c_int64), ("kind", ctypes.c_int),
                ("scale", ctypes.c_void_p), ("scale_stride", ctypes.c_int64),
                ("group", ctypes.c_int64), ("block_rows", ctypes.c_int64),
                ("part_rows", ctypes.c_int64)]


def pool_structs(w13: torch.Tensor, w2: torch.Tensor,
                 scales: ExpertScales | None) -> tuple[PoolStruct, PoolStruct]:
    """w13's and w2's pool_t (the caller checks the pools with `check_pools`)."""
    if scales is None:
        return (PoolStruct(w13.data_ptr(), w13.stride(0), 0, None, 0, 0, 1, 1),
                PoolStruct(w2.data_ptr(), w2.stride(0), 0, None, 0, 0, 1, 1))
    fmt, kind = scales.fmt, C_KINDS[scales.fmt.kind]
    inter, hidden = w13.shape[1] // 2, w2.shape[1]
    return tuple(PoolStruct(w.data_ptr(), w.stride(0), kind, s.data_ptr(), s.stride(0),
                       fmt.block_cols, fmt.block_rows, rows)
                 for w, s, rows in ((w13, scales.w13, inter), (w2, scales.w2, hidden)))


class MoELayerStruct(ctypes.Structure):
    """moe_block.c's moe_layer_t."""

    _fields_ = [("router", ctypes.c_void_p), ("router_bias", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("hidden", "inter", "experts", "top_k")] + [
        ("scoring", ctypes.c_int), ("renormalize", ctypes.c_int), ("scaling", ctypes.c_float)]


@dataclass(frozen=True)
class MoELayer:
    """A MoE layer's router struct (its shapes too: `struct.hidden`, ...) and the tensors it
    points into (kept alive with it)."""

    struct: MoELayerStruct
    tensors: tuple[torch.Tensor, ...]


def moe_layer(router: torch.Tensor, router_bias: torch.Tensor | None, inter: int, top_k: int,
              scoring: str, renormalize: bool, scaling: float) -> MoELayer:
    """The struct for one layer's router `[E, H]` (and bias `[E]`), bf16 and contiguous,
    routing as `scoring` (a key of SCORINGS) says."""
    num_experts, hidden = router.shape
    for name, tensor, shape in (("router", router, (num_experts, hidden)),
                                ("router bias", router_bias, (num_experts,))):
        if tensor is not None and (tensor.dtype != torch.bfloat16 or tuple(tensor.shape) != shape
                                   or not tensor.is_contiguous() or tensor.device.type != "cpu"):
            raise ValueError(f"moe_block takes a contiguous bf16 CPU {name}, got "
                             f"{tuple(tensor.shape)} {tensor.dtype} where {shape} was expected")
    if not 0 < top_k <= num_experts or scoring not in SCORINGS:
        raise ValueError(f"moe_block: top {top_k} of {num_experts} experts by {scoring!r}")
    bias = None if router_bias is None else router_bias.data_ptr()
    struct = MoELayerStruct(router.data_ptr(), bias, hidden, inter, num_experts, top_k,
                            SCORINGS[scoring], int(renormalize), scaling)
    return MoELayer(struct, tuple(t for t in (router, router_bias) if t is not None))
