"""Fused MoE on GPUs (Triton), reading experts through a slot map.

Legend: T tokens, k experts per token, P = T*k (token, expert) pairs, E logical experts,
S slots, H hidden, I intermediate, BM/BN/BK block sizes.

Design (as vLLM's and SGLang's fused_moe):
1. align (moe_align.py): sort the P pairs by slot and pad each slot's run to a multiple of
   BM, so every M block of the grouped GEMMs reads one slot's weights. All on the device, no
   host sync: the grid is sized for the worst case and blocks past the padded length exit.
2. gate_up: gather each pair's token row inside the load, multiply by w13[slot] (gate and up
   halves as two accumulators), store SiLU(gate) * up: the [P, 2I] product never exists.
3. down: multiply by w2[slot], scale by the routing weight, store one row per pair; the k rows
   of a token are summed afterwards (deterministic, unlike atomics).
A slot map's values index a row space (`ExpertRows`): each row's weights are an element offset
from the pool's pointer, so an expert read in place outside the pool (on a GPU: pinned host
memory mapped into the device's address space, while the pager copies it into a slot) takes
the same code path as a resident one.
Quantized pools (int8, int4, FP8, MXFP4; mox.kernels.quant) are dequantized tile by tile inside
the K loops (each value times its block's scale), so only stored bytes cross memory.
fp32 accumulation; pair, token and slot offsets are int64, because int32 offsets overflow
once P * H passes 2^31 (vLLM #5938). Under TRITON_INTERPRET=1, UPCAST loads fp32: the
interpreter's bf16 arithmetic is silently wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_align import ALIGN_KERNEL_MAX_PAIRS, align_pairs, align_pairs_triton
from .moe_config import MoEKernelConfig, get_config
from .quant import INT4, MXFP4, ExpertScales

ROW_ALIGN = 8          # elements: 16 bytes of bf16 (see ExpertRows.aligned)
# `_weight_tile`'s nibble decodings (constexpr: a jitted function may read such globals)
PACKED_INT4, PACKED_FP4 = tl.constexpr(1), tl.constexpr(2)
PACKED_KINDS = {INT4: 1, MXFP4: 2}


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class MappedExpert:
    """An expert read in place, laid out as one slot of the pools: `w13 [2I, H']`,
    `w2 [H, I']`, and a quantized pool's scales `s13 [2, nb, kb]`, `s2 [nb, kb]`."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None


@dataclass(frozen=True)
class ExpertRows:
    """The rows a slot map's values index: each row's w13, w2 (and scales) as element offsets
    from the pool tensors' first elements. Rows [0, S) are the pools' slots; row S + i is
    `mapped[i]`, which this object keeps alive (the kernels read it by address)."""

    w13: torch.Tensor                 # [R] int64
    w2: torch.Tensor                  # [R] int64
    s13: torch.Tensor | None          # [R] int64, quantized pools only
    s2: torch.Tensor | None
    mapped: tuple[MappedExpert, ...] = ()
    # every weight offset a multiple of ROW_ALIGN elements: the kernels may load rows in
    # vectors (an offset read at run time tells the compiler nothing of its alignment)
    aligned: bool = False

    @property
    def num_rows(self) -> int:
        return self.w13.numel()


def expert_rows(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None = None,
                mapped: tuple[MappedExpert, ...] = ()) -> ExpertRows:
    """The row space of these pools plus `mapped` experts. The slots' offsets are device
    arithmetic (no host sync: built in the hot path when nothing is mapped); a mapped expert
    must have a slot's dtype, shape and strides and be readable where the pools are (the same
    GPU, or pinned host memory; any CPU tensor under the interpreter)."""
    def offsets(pool: torch.Tensor, extra: list[torch.Tensor | None],
                name: str) -> tuple[torch.Tensor, list[int]]:
        """The rows' offsets on the pool's device, and the mapped ones' on the host."""
        slots = torch.arange(0, pool.shape[0] * pool.stride(0), pool.stride(0),
                             dtype=torch.int64, device=pool.device)      # one launch
        size, others = pool.element_size(), []
        for i, t in enumerate(extra):
            if t is None:
                raise ValueError(f"mapped expert {i}: no {name} (the pools have one)")
            if (t.dtype, t.shape, t.stride()) != (pool.dtype, pool.shape[1:], pool.stride()[1:]):
                raise ValueError(f"mapped expert {i}: {name} must be laid out as a slot of the "
                                 f"pool ({pool.dtype}, {tuple(pool.shape[1:])}, strides "
                                 f"{pool.stride()[1:]}); got {t.dtype}, {tuple(t.shape)}, "
                                 f"strides {t.stride()}")
            if pool.is_cuda and not (t.device == pool.device or t.is_pinned()):
                raise ValueError(f"mapped expert {i}: {name} is on {t.device}, not readable "
                                 f"from {pool.device} (use pinned host memory)")
            delta = t.data_ptr() - pool.data_ptr()
            if delta % size:
                raise ValueError(f"mapped expert {i}: {name} is not aligned to its dtype")
            others.append(delta // size)
        if not others:
            return slots, others
        return torch.cat((slots, torch.tensor(others, dtype=torch.int64).to(pool.device))), others
    w13_rows, w13_mapped = offsets(w13, [m.w13 for m in mapped], "w13")
    w2_rows, w2_mapped = offsets(w2, [m.w2 for m in mapped], "w2")
    s13_rows, s2_rows = None, None
    if scales is not None:
        s13_rows = offsets(scales.w13, [m.s13 for m in mapped], "s13")[0]
        s2_rows = offsets(scales.w2, [m.s2 for m in mapped], "s2")[0]
    return ExpertRows(w13_rows, w2_rows, s13_rows, s2_rows, tuple(mapped),
                      rows_aligned([w13.stride(0), w2.stride(0), *w13_mapped, *w2_mapped]))


def rows_aligned(offsets: list[int]) -> bool:
    """Whether weight offsets (slot strides, mapped experts' distances) keep every row's
    start as aligned as the pool's own."""
    return all(offset % ROW_ALIGN == 0 for offset in offsets)


@triton.jit
def _block_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (M block, N block), GROUP_M M blocks per N sweep for L2 reuse."""
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_size)
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_n, k, mask, stride_wn, stride_wk, stride_sn, stride_sk,
                 block_rows, block_cols, DTYPE: tl.constexpr, QUANT: tl.constexpr,
                 PACKED: tl.constexpr):
    """The `[BK, BN]` tile of weight rows `offs_n` at inputs `k`, in DTYPE: loaded as is, or
    dequantized here, inside the K loop (int8, FP8, or nibbles: int4 + 8 (PACKED_INT4) or
    E2M1 codes (PACKED_FP4); times the scale of each value's block: `block_cols` is the row
    length for per-channel scales)."""
    if PACKED != 0:
        packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k // 2)[:, None] * stride_wk,
                         mask=mask, other=0)
        code = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 15
        if PACKED == PACKED_INT4:
            w = (code - 8).to(tl.float32)
        else:                 # E2M1: sign, 2 exponent bits, 1 mantissa bit; e = 0 subnormal
            exponent, mantissa = (code >> 1) & 3, (code & 1).to(tl.float32)
            magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                                 (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
            w = tl.where(code >= 8, -magnitude, magnitude)
    else:
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk, mask=mask,
                    other=0.0)
    if QUANT:
        scale = tl.load(s_ptr + (offs_n // block_rows)[None, :] * stride_sn
                        + (k // block_cols)[:, None] * stride_sk, mask=mask, other=0.0)
        w = w.to(tl.float32) * scale
    return w.to(DTYPE)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, w13_rows_ptr, s13_rows_ptr, out_ptr,
                    sorted_pairs_ptr, block_slot_ptr,
                    num_padded_ptr, num_pairs, num_m_blocks, hidden, inter, top_k,
                    stride_xt, stride_xh, stride_wn, stride_wh, stride_op, stride_oi,
                    stride_sg, stride_sn, stride_sk, block_rows, block_cols,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
                    QUANT: tl.constexpr, PACKED: tl.constexpr, ALIGNED: tl.constexpr):
    pid_m, pid_n = _block_coords(num_m_blocks, inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    is_pair = pair < num_pairs
    token = pair // top_k                                                  # the gather
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    row = tl.load(w13_rows_ptr + slot)                         # the slot's, or mapped
    if ALIGNED:
        row = tl.multiple_of(row, 8)
    gate_ptr = w13_ptr + row
    up_ptr = gate_ptr + inter * stride_wn
    gate_scale = s13_ptr + tl.load(s13_rows_ptr + slot)       # [2, nb, kb]: gate's, up's
    up_scale = gate_scale + stride_sg
    n_ok = offs_n < inter
    dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(hidden, BLOCK_K)):
        k = step * BLOCK_K + offs_k
        k_ok = k < hidden
        mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptrs, mask=is_pair[:, None] & k_ok[None, :], other=0.0).to(dtype)
        g = _weight_tile(gate_ptr, gate_scale, offs_n, k, mask, stride_wn, stride_wh,
                         stride_sn, stride_sk, block_rows, block_cols, dtype, QUANT, PACKED)
        u = _weight_tile(up_ptr, up_scale, offs_n, k, mask, stride_wn, stride_wh,
                         stride_sn, stride_sk, block_rows, block_cols, dtype, QUANT, PACKED)
        if IEEE_DOT:
            acc_gate = tl.dot(a, g, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, g, acc_gate)
            acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K * stride_xh
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up                         # SiLU(gate) * up
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_oi
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, s2_ptr, w2_rows_ptr, s2_rows_ptr, out_ptr, weights_ptr,
                 sorted_pairs_ptr, block_slot_ptr, num_padded_ptr, num_pairs, num_m_blocks,
                 hidden, inter, stride_ap, stride_ai, stride_wh, stride_wi, stride_op,
                 stride_oh, stride_sn, stride_sk, block_rows, block_cols,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
                 QUANT: tl.constexpr, PACKED: tl.constexpr, ALIGNED: tl.constexpr):
    pid_m, pid_n = _block_coords(num_m_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    is_pair = pair < num_pairs
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None] * stride_ap + offs_k[None, :] * stride_ai
    row = tl.load(w2_rows_ptr + slot)
    if ALIGNED:
        row = tl.multiple_of(row, 8)
    w_ptr = w2_ptr + row
    scale_ptr = s2_ptr + tl.load(s2_rows_ptr + slot)
    n_ok = offs_n < hidden
    dtype = tl.float32 if UPCAST else act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(inter, BLOCK_K)):
        k = step * BLOCK_K + offs_k
        k_ok = k < inter
        a = tl.load(a_ptrs, mask=is_pair[:, None] & k_ok[None, :], other=0.0).to(dtype)
        b = _weight_tile(w_ptr, scale_ptr, offs_n, k, k_ok[:, None] & n_ok[None, :],
                         stride_wh, stride_wi, stride_sn, stride_sk, block_rows, block_cols,
                         dtype, QUANT, PACKED)
        if IEEE_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ai
    routing_weight = tl.load(weights_ptr + pair, mask=is_pair, other=0.0)   # f32
    acc = acc * routing_weight[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc, mask=is_pair[:, None] & n_ok[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, slot_of: torch.Tensor,
                     config: MoEKernelConfig | None = None,
                     scales: ExpertScales | None = None,
                     rows: ExpertRows | None = None) -> torch.Tensor:
    """Launcher: checks layouts, aligns pairs, runs both grouped GEMMs, sums the k rows.
    `scales`: w13 and w2 are stored quantized (mox.kernels.quant), dequantized tile by tile
    inside the K loops. `rows`: the row space `slot_of` indexes (`expert_rows`; default the
    pools' slots)."""
    num_tokens, top_k = topk_ids.shape
    num_slots, hidden = w2.shape[:2]
    inter = w13.shape[1] // 2
    assert scales is not None or x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "need row-major rows"
    assert x.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    rows = rows if rows is not None else expert_rows(w13, w2, scales)
    assert rows.num_rows >= num_slots and (rows.s13 is None) == (scales is None)
    if config is None:
        device_name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        config = get_config(slot_of.numel(), inter, device_name, x.dtype, num_tokens)
    num_pairs = num_tokens * top_k
    align = align_pairs_triton if num_pairs <= ALIGN_KERNEL_MAX_PAIRS else align_pairs
    aligned = align(topk_ids.reshape(-1).contiguous(), slot_of.contiguous(), rows.num_rows,
                    config.block_m)
    num_m_blocks = aligned.block_slot.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)          # [P, I]
    pair_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    fmt = None if scales is None else scales.fmt
    flags = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 GROUP_M=config.group_m, UPCAST=is_interpreter(),
                 IEEE_DOT=x.dtype == torch.float32, QUANT=fmt is not None,
                 PACKED=PACKED_KINDS.get(fmt.kind if fmt else None, 0),
                 ALIGNED=rows.aligned, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    # (without QUANT the scale pointers and offsets are never read: the weights' stand in)
    s13, s13_rows = (w13, rows.w13) if scales is None else (scales.w13, rows.s13)
    s13_strides = (0, 0, 0) if scales is None else s13.stride()[1:]
    block_rows = 1 if fmt is None else fmt.block_rows
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, config.block_n),)](
        x, w13, s13, rows.w13, s13_rows, act, aligned.sorted_pairs, aligned.block_slot,
        aligned.num_padded, num_pairs, num_m_blocks, hidden, inter, top_k,
        x.stride(0), x.stride(1), w13.stride(1), w13.stride(2),
        act.stride(0), act.stride(1), *s13_strides, block_rows,
        hidden if fmt is None or fmt.block_cols == 0 else fmt.block_cols, **flags)
    s2, s2_rows = (w2, rows.w2) if scales is None else (scales.w2, rows.s2)
    s2_strides = (0, 0) if scales is None else s2.stride()[1:]
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, config.block_n),)](
        act, w2, s2, rows.w2, s2_rows, pair_out, topk_weights.reshape(-1),
        aligned.sorted_pairs, aligned.block_slot, aligned.num_padded, num_pairs, num_m_blocks,
        hidden, inter, act.stride(0), act.stride(1), w2.stride(1), w2.stride(2),
        pair_out.stride(0), pair_out.stride(1), *s2_strides, block_rows,
        inter if fmt is None or fmt.block_cols == 0 else fmt.block_cols, **flags)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)          # [T, H]
