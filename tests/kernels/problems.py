"""Random fused-MoE problems shared by the kernel tests."""

from __future__ import annotations

import torch

from mox.kernels import NOT_RESIDENT, softmax_topk


def make_problem(num_tokens: int, hidden: int, inter: int, num_experts: int, k: int,
                 num_slots: int, dtype: torch.dtype, seed: int = 0, num_missing: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_slots, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_slots, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = softmax_topk(logits, k, renormalize=True)
    # a scattered residency table: experts sit in arbitrary slots, some not resident
    slots = torch.randperm(num_slots, generator=gen)[:num_experts].to(torch.int32)
    missing = torch.randperm(num_experts, generator=gen)[:num_missing]
    slots[missing] = NOT_RESIDENT
    return x, w13, w2, weights, ids, slots
