"""Random fused-MoE problems shared by the kernel tests."""

from __future__ import annotations

import torch

from mox.kernels import NOT_RESIDENT, ExpertScales, WeightFormat, quantize, softmax_topk


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


def quantized_pool(w13: torch.Tensor, w2: torch.Tensor, fmt: WeightFormat):
    """Slot pools as mox holds them: stored weights, scales `[S, 2, nb, kb]`, `[S, nb, kb]`."""
    inter = w13.shape[1] // 2
    parts = {"gate": [], "up": [], "down": []}
    for slot in range(w13.shape[0]):
        for name, weight in (("gate", w13[slot, :inter]), ("up", w13[slot, inter:]),
                             ("down", w2[slot])):
            parts[name].append(quantize(weight, fmt))
    data13 = torch.stack([torch.cat((g[0], u[0])) for g, u in zip(parts["gate"], parts["up"])])
    scale13 = torch.stack([torch.stack((g[1], u[1])) for g, u in zip(parts["gate"],
                                                                        parts["up"])])
    data2 = torch.stack([d[0] for d in parts["down"]])
    scale2 = torch.stack([d[1] for d in parts["down"]])
    return data13, data2, ExpertScales(fmt, scale13, scale2)
