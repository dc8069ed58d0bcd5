"""The torch fused-MoE path against the plain reference, through arbitrary slot maps."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import (
    NOT_RESIDENT,
    MoEWorkspace,
    fused_moe,
    moe_torch,
    reference_fused_moe,
    softmax_topk,
)
from tests.kernels.problems import make_problem


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,k,num_slots", [
    (1, 16, 8, 4, 2, 4), (7, 32, 16, 8, 2, 12), (33, 64, 32, 16, 4, 20), (64, 32, 48, 6, 6, 6),
    (9, 36, 20, 6, 2, 6),          # bf16 rows of 72 and 40 bytes: grouped_mm refuses them
])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("grouped_mm_max_rows", [0, 10**9], ids=["looped", "grouped_mm"])
def test_torch_path_matches_reference(num_tokens, hidden, inter, num_experts, k, num_slots,
                                      dtype, atol, grouped_mm_max_rows, monkeypatch):
    monkeypatch.setattr(moe_torch, "GROUPED_MM_MAX_ROWS_PER_EXPERT", grouped_mm_max_rows)
    monkeypatch.setattr(moe_torch, "GROUPED_MM_MIN_ACTIVE_FRACTION", 0.0)
    args = make_problem(num_tokens, hidden, inter, num_experts, k, num_slots, dtype,
                        num_missing=num_experts // 4)
    expected = reference_fused_moe(*args)
    actual = fused_moe(*args, backend="torch", workspace=MoEWorkspace())
    assert actual.dtype == dtype and actual.shape == (num_tokens, hidden)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_non_resident_experts_contribute_nothing():
    x, w13, w2, weights, ids, slots = make_problem(20, 16, 8, 8, 2, 8, torch.float32,
                                                   num_missing=3)
    out = fused_moe(x, w13, w2, weights, ids, slots)
    resident = slots[ids.long()] != NOT_RESIDENT                       # [T, k]
    kept = torch.where(resident, weights, torch.zeros_like(weights))
    full_slots = slots.clone()
    full_slots[full_slots == NOT_RESIDENT] = 0    # any slot: its weight is zeroed above
    torch.testing.assert_close(out, fused_moe(x, w13, w2, kept, ids, full_slots))


def test_moving_an_expert_to_another_slot_changes_nothing():
    x, w13, w2, weights, ids, slots = make_problem(16, 16, 8, 4, 2, 8, torch.float32)
    before = fused_moe(x, w13, w2, weights, ids, slots)
    free = next(s for s in range(8) if s not in slots.tolist())
    w13[free], w2[free] = w13[slots[2]], w2[slots[2]]
    slots[2] = free
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, slots), before)


def test_softmax_topk_matches_definition():
    logits = torch.randn(10, 8)
    weights, ids = softmax_topk(logits, 3, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    assert (weights[:, :1] >= probs.max(-1, keepdim=True).values - 1e-7).all()
    renormed, _ = softmax_topk(logits, 3, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(10))


def test_bad_arguments_are_refused():
    args = make_problem(4, 16, 8, 4, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        fused_moe(*args, backend="cuda-magic")
    with pytest.raises(ValueError, match="activation"):
        fused_moe(*args, activation="gelu")


@pytest.mark.parametrize("num_tokens", [1, 200, 3000])
def test_torch_path_larger_shapes(num_tokens):
    args = make_problem(num_tokens, 256, 128, 32, 4, 40, torch.float32, seed=7, num_missing=5)
    workspace = MoEWorkspace()
    first = fused_moe(*args, backend="torch", workspace=workspace)
    expected = _per_expert_definition(*args)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=1e-4)
    # a reused workspace changes nothing
    torch.testing.assert_close(fused_moe(*args, backend="torch", workspace=workspace), first)


def _per_expert_definition(x, w13, w2, weights, ids, slot_of):
    """The reference's math, vectorised per logical expert (the token loop is too slow here)."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for expert, slot in enumerate(slot_of.tolist()):
        if slot == NOT_RESIDENT:
            continue
        token, j = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = x[token] @ w13[slot].t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, weights[token, j, None] * (act @ w2[slot].t()))
    return out
