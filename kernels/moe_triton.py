"""Fused MoE on GPUs (Triton), reading experts through a slot map.

Legend: T tokens, k experts per token, P = T*k (token, expert) pairs, E logical experts,
S slots, H hidden, I intermediate, BM/BN/BK block sizes.

Design (as vLLM's and SGLang's fused_moe):
1. align: sort the P pairs by slot and pad each slot's run to a multiple of BM, so every M
   block of the grouped GEMMs reads one slot's weights. All on the device, no host sync: the
   grid is sized for the worst case and blocks past the padded length exit at once.
2. gate_up: gather each pair's token row inside the load, multiply by w13[slot] (gate and up
   halves as two accumulators), store SiLU(gate) * up: the [P, 2I] product never exists.
3. down: multiply by w2[slot], scale by the routing weight, store one row per pair; the k rows
   of a token are summed afterwards (deterministic, unlike atomics).
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

from .moe_config import MoEKernelConfig, get_config


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class AlignedPairs:
    sorted_pairs: torch.Tensor      # [M_max] int32: pair ids grouped by slot; pad = P
    block_slot: torch.Tensor        # [M_max / BM] int32: the slot each M block multiplies by
    num_padded: torch.Tensor        # [1] int32: used length of sorted_pairs, on the device


def align_pairs(topk_ids: torch.Tensor, slot_of: torch.Tensor, num_slots: int,
                block_m: int) -> AlignedPairs:
    """Group the (token, expert) pairs by slot, each run padded to BM; drops non-resident."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    slots = slot_of[topk_ids.reshape(-1).long()].long()                   # [P]
    key = torch.where(slots >= 0, slots, num_slots)                       # non-resident: last
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))                     # [S+1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_slots] = 0
    padded_end = padded.cumsum(0)                                         # [S+1]
    # worst case: every distinct slot wastes BM-1 positions; at most min(E, P) distinct slots
    max_len = triton.cdiv(num_pairs + min(slot_of.numel(), num_pairs) * (block_m - 1),
                          block_m) * block_m
    order = torch.argsort(key, stable=True)                               # [P]
    sorted_key = key[order]
    run_start = counts.cumsum(0) - counts                                 # [S+1]
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_key]
    dest_start = padded_end - padded
    dest_start[num_slots] = max_len                   # non-resident pairs land past the end
    sorted_pairs = torch.full((max_len + num_pairs,), num_pairs, dtype=torch.int32,
                              device=device)
    sorted_pairs.scatter_(0, dest_start[sorted_key] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_len, block_m, device=device)
    block_slot = torch.searchsorted(padded_end[:num_slots], block_starts, right=True)
    return AlignedPairs(sorted_pairs[:max_len], block_slot.to(torch.int32),
                        padded_end[num_slots:].to(torch.int32))


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
def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_slot_ptr, num_padded_ptr,
                    num_pairs, num_m_blocks, hidden, inter, top_k,
                    stride_xt, stride_xh, stride_ws, stride_wn, stride_wh, stride_op, stride_oi,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
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
    g_ptrs = w13_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
    u_ptrs = g_ptrs + inter * stride_wn
    n_ok = offs_n < inter
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - step * BLOCK_K
        a = tl.load(a_ptrs, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        if IEEE_DOT:
            acc_gate = tl.dot(a, g, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, g, acc_gate)
            acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up                         # SiLU(gate) * up
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_oi
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_slot_ptr,
                 num_padded_ptr, num_pairs, num_m_blocks, hidden, inter,
                 stride_ap, stride_ai, stride_ws, stride_wh, stride_wi, stride_op, stride_oh,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
    pid_m, pid_n = _block_coords(num_m_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    is_pair = pair < num_pairs
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None] * stride_ap + offs_k[None, :] * stride_ai
    b_ptrs = w2_ptr + slot * stride_ws + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi
    n_ok = offs_n < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - step * BLOCK_K
        a = tl.load(a_ptrs, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ai
        b_ptrs += BLOCK_K * stride_wi
    routing_weight = tl.load(weights_ptr + pair, mask=is_pair, other=0.0)   # f32
    acc = acc * routing_weight[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_op + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc, mask=is_pair[:, None] & n_ok[None, :])


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, slot_of: torch.Tensor,
                     config: MoEKernelConfig | None = None) -> torch.Tensor:
    """Launcher: checks layouts, aligns pairs, runs both grouped GEMMs, sums the k rows."""
    num_tokens, top_k = topk_ids.shape
    num_slots, hidden, inter = w2.shape
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "need row-major rows"
    assert x.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    if config is None:
        device_name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        config = get_config(slot_of.numel(), inter, device_name, x.dtype, num_tokens)
    num_pairs = num_tokens * top_k
    aligned = align_pairs(topk_ids, slot_of, num_slots, config.block_m)
    num_m_blocks = aligned.block_slot.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)          # [P, I]
    pair_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    flags = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 GROUP_M=config.group_m, UPCAST=is_interpreter(),
                 IEEE_DOT=x.dtype == torch.float32, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, config.block_n),)](
        x, w13, act, aligned.sorted_pairs, aligned.block_slot, aligned.num_padded,
        num_pairs, num_m_blocks, hidden, inter, top_k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        act.stride(0), act.stride(1), **flags)
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, config.block_n),)](
        act, w2, pair_out, topk_weights.reshape(-1), aligned.sorted_pairs, aligned.block_slot,
        aligned.num_padded, num_pairs, num_m_blocks, hidden, inter,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
        pair_out.stride(0), pair_out.stride(1), **flags)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)          # [T, H]
