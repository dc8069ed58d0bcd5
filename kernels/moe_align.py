"""The fused MoE's first step: sort the (token, expert) pairs by the row their expert reads
(a slot, or an expert mapped in place) and pad each row's run to a multiple of BM, so every M
block of the grouped GEMMs multiplies by one row's weights. All on the device, no host sync:
the length is the worst case (every run wasting BM - 1 positions), and the GEMMs' blocks past
the padded length exit at once.

Two ways to the same result:
- `align_pairs`: torch ops (a histogram over the rows, cumsums, a stable argsort): any P, but
  ~17 kernels, which a CUDA-graphed decode step replays in every MoE layer;
- `align_pairs_triton`: one kernel, one program, for up to ALIGN_KERNEL_MAX_PAIRS pairs
  (decode): each pair's rank in its run and each run's start counted by comparing every pair
  with every other (P^2 / 2 compares: 128k at 512 pairs, a few microseconds).

Legend: P pairs, E experts, R rows (`ExpertRows.num_rows`), BM the GEMMs' M block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN_KERNEL_MAX_PAIRS = 512      # 64 decode rows x 8 experts each
_CHUNK = 64                       # pairs a side of one compare tile ([64, 64])


@dataclass(frozen=True)
class AlignedPairs:
    sorted_pairs: torch.Tensor      # [M_max] int32: pair ids grouped by row; pad = P
    block_slot: torch.Tensor        # [M_max / BM] int32: the row each M block multiplies by
    num_padded: torch.Tensor        # [1] int32: used length of sorted_pairs, on the device


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The padded length's worst case: every distinct row (at most min(E, P)) wastes BM - 1
    positions."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1),
                       block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, slot_of: torch.Tensor, num_slots: int,
                block_m: int) -> AlignedPairs:
    """Group the (token, expert) pairs by slot (a row of `ExpertRows`: `num_slots` counts
    them all), each run padded to BM; drops non-resident."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    slots = slot_of[topk_ids.reshape(-1).long()].long()                   # [P]
    key = torch.where(slots >= 0, slots, num_slots)                       # non-resident: last
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))                     # [S+1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_slots] = 0
    padded_end = padded.cumsum(0)                                         # [S+1]
    max_len = max_padded(num_pairs, slot_of.numel(), block_m)
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
def _keys(ids_ptr, slot_of_ptr, offs, num_pairs, num_rows):
    """Each pair's row, `num_rows` for a non-resident expert (sorted last)."""
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    row = tl.load(slot_of_ptr + expert, mask=ok, other=-1)
    return tl.where(row >= 0, row, num_rows), ok


@triton.jit
def _align_kernel(ids_ptr, slot_of_ptr, count_ptr, rank_ptr, sorted_ptr, block_slot_ptr,
                  num_padded_ptr, num_pairs, num_rows, num_blocks, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, RUN_BLOCKS: tl.constexpr, BLOCKS: tl.constexpr,
                  TAIL: tl.constexpr):
    offs_c = tl.arange(0, CHUNK)
    # pass 1: each pair's run length and rank in its run (pairs before it with its row)
    for i0 in range(0, num_pairs, CHUNK):
        key_i, ok_i = _keys(ids_ptr, slot_of_ptr, i0 + offs_c, num_pairs, num_rows)
        count = tl.zeros((CHUNK,), tl.int32)
        rank = tl.zeros((CHUNK,), tl.int32)
        for j0 in range(0, num_pairs, CHUNK):
            key_j, ok_j = _keys(ids_ptr, slot_of_ptr, j0 + offs_c, num_pairs, num_rows)
            same = (key_i[:, None] == key_j[None, :]) & ok_j[None, :]
            count += tl.sum(same.to(tl.int32), axis=1)
            before = (j0 + offs_c)[None, :] < (i0 + offs_c)[:, None]
            rank += tl.sum((same & before).to(tl.int32), axis=1)
        tl.store(count_ptr + i0 + offs_c, count, mask=ok_i)
        tl.store(rank_ptr + i0 + offs_c, rank, mask=ok_i)
    tl.debug_barrier()                       # (pass 2 reads every pair's count and rank)
    # pass 2: a run starts after the padded runs of every lower row; its pairs go there in
    # order, its first pair pads the run and names its M blocks
    total = 0
    for i0 in range(0, num_pairs, CHUNK):
        key_i, ok_i = _keys(ids_ptr, slot_of_ptr, i0 + offs_c, num_pairs, num_rows)
        count_i = tl.load(count_ptr + i0 + offs_c, mask=ok_i, other=0)
        rank_i = tl.load(rank_ptr + i0 + offs_c, mask=ok_i, other=1)
        padded_i = (count_i + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        lead_i = ok_i & (rank_i == 0) & (key_i < num_rows)          # a resident run's first
        total += tl.sum(tl.where(lead_i, padded_i, 0), axis=0)
        start = tl.zeros((CHUNK,), tl.int32)
        for j0 in range(0, num_pairs, CHUNK):
            key_j, ok_j = _keys(ids_ptr, slot_of_ptr, j0 + offs_c, num_pairs, num_rows)
            count_j = tl.load(count_ptr + j0 + offs_c, mask=ok_j, other=0)
            rank_j = tl.load(rank_ptr + j0 + offs_c, mask=ok_j, other=1)
            padded_j = (count_j + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            lower = (rank_j == 0)[None, :] & (key_j[None, :] < key_i[:, None]) & ok_j[None, :]
            start += tl.sum(tl.where(lower, padded_j[None, :], 0), axis=1)
        resident = ok_i & (key_i < num_rows)
        tl.store(sorted_ptr + start + rank_i, (i0 + offs_c).to(tl.int32), mask=resident)
        pad = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + (start + count_i)[:, None] + pad[None, :],
                 num_pairs + tl.zeros((CHUNK, BLOCK_M), tl.int32),
                 mask=lead_i[:, None] & (pad[None, :] < (padded_i - count_i)[:, None]))
        run_block = tl.arange(0, RUN_BLOCKS)
        tl.store(block_slot_ptr + (start // BLOCK_M)[:, None] + run_block[None, :],
                 key_i[:, None] + tl.zeros((CHUNK, RUN_BLOCKS), tl.int32),
                 mask=lead_i[:, None] & (run_block[None, :] < (padded_i // BLOCK_M)[:, None]))
    tl.store(num_padded_ptr, total)
    for t0 in range(total, num_blocks * BLOCK_M, TAIL):  # positions past the runs: padding
        offs_t = t0 + tl.arange(0, TAIL)
        tl.store(sorted_ptr + offs_t, num_pairs + tl.zeros((TAIL,), tl.int32),
                 mask=offs_t < num_blocks * BLOCK_M)
    tail = tl.arange(0, BLOCKS)                          # blocks past the runs: no row
    tl.store(block_slot_ptr + tail, num_rows + tl.zeros((BLOCKS,), tl.int32),
             mask=(tail >= total // BLOCK_M) & (tail < num_blocks))


def align_pairs_triton(topk_ids: torch.Tensor, slot_of: torch.Tensor, num_slots: int,
                       block_m: int) -> AlignedPairs:
    """`align_pairs` in one kernel launch (up to ALIGN_KERNEL_MAX_PAIRS pairs)."""
    num_pairs = topk_ids.numel()
    assert 0 < num_pairs <= ALIGN_KERNEL_MAX_PAIRS, num_pairs
    assert topk_ids.dtype == slot_of.dtype == torch.int32
    assert topk_ids.is_contiguous() and slot_of.is_contiguous()
    max_len = max_padded(num_pairs, slot_of.numel(), block_m)
    device = topk_ids.device
    scratch = torch.empty(2, num_pairs, dtype=torch.int32, device=device)     # count, rank
    sorted_pairs = torch.empty(max_len, dtype=torch.int32, device=device)
    block_slot = torch.empty(max_len // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids, slot_of, scratch[0], scratch[1], sorted_pairs, block_slot,
                        num_padded, num_pairs, num_slots, max_len // block_m,
                        BLOCK_M=block_m, CHUNK=_CHUNK,
                        RUN_BLOCKS=triton.next_power_of_2(triton.cdiv(num_pairs, block_m)),
                        BLOCKS=triton.next_power_of_2(max_len // block_m), TAIL=1024,
                        num_warps=4)
    return AlignedPairs(sorted_pairs, block_slot, num_padded)
