"""The Triton kernels (under TRITON_INTERPRET=1 without a GPU) against the plain reference.

Interpreter time grows with programs x loop steps: small shapes, big tiles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.kernels import (
    NOT_RESIDENT,
    MoEKernelConfig,
    fused_moe,
    fused_moe_triton,
    reference_fused_moe,
)
from mox.kernels.moe_align import ALIGN_KERNEL_MAX_PAIRS, align_pairs, align_pairs_triton
from tests.kernels.problems import make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BIG_TILES = MoEKernelConfig(block_m=16, block_n=64, block_k=64)


def _on_device(args):
    return [a.to(DEVICE) for a in args]


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,k,num_slots,num_missing", [
    (1, 64, 32, 8, 2, 8, 0),          # one token
    (19, 48, 40, 8, 2, 12, 2),        # T not a multiple of BM; H, I not powers of two
    (5, 32, 32, 64, 8, 64, 16),       # E=64: most experts get no tokens; k=8
    (24, 40, 24, 16, 1, 20, 4),       # k=1
])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2),
                                        (torch.float16, 5e-3)])
def test_triton_matches_reference(num_tokens, hidden, inter, num_experts, k, num_slots,
                                  num_missing, dtype, atol):
    args = _on_device(make_problem(num_tokens, hidden, inter, num_experts, k, num_slots, dtype,
                                   seed=num_tokens, num_missing=num_missing))
    expected = reference_fused_moe(*args)
    actual = fused_moe_triton(*args, config=BIG_TILES)
    assert actual.shape == (num_tokens, hidden) and actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_triton_and_torch_paths_agree_with_default_configs():
    args = _on_device(make_problem(40, 64, 64, 8, 2, 8, torch.float32, seed=3))
    torch.testing.assert_close(fused_moe(*args, backend="triton"),
                               fused_moe(*args, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("align", [align_pairs, align_pairs_triton])
def test_align_groups_pairs_by_slot_padded_to_block(align):
    ids = torch.tensor([[0, 1], [1, 2], [3, 1], [2, 0]], dtype=torch.int32,    # P = 8
                       device=DEVICE)
    slot_of = torch.tensor([5, 2, NOT_RESIDENT, 0], dtype=torch.int32,        # expert 2 absent
                           device=DEVICE)
    aligned = align(ids.reshape(-1), slot_of, num_slots=6, block_m=4)
    num_padded = int(aligned.num_padded)
    # slots 0 (1 pair), 2 (3 pairs), 5 (2 pairs): three runs of one block each
    assert num_padded == 12 and aligned.block_slot[:3].tolist() == [0, 2, 5]
    pairs = aligned.sorted_pairs[:num_padded].view(3, 4)
    flat_slots = slot_of[ids.reshape(-1).long()]
    for block, slot in zip(pairs, aligned.block_slot[:3].tolist()):
        real = block[block < 8]
        assert (flat_slots[real.long()] == slot).all()
    # pairs 3 and 6 route to the absent expert 2 and are dropped
    assert sorted(aligned.sorted_pairs[aligned.sorted_pairs < 8].tolist()) == [0, 1, 2, 4, 5, 7]
    assert (aligned.sorted_pairs[num_padded:] == 8).all()     # worst-case tail is all padding


@settings(max_examples=25, deadline=None)
@given(num_pairs=st.integers(1, ALIGN_KERNEL_MAX_PAIRS), num_experts=st.integers(1, 80),
       extra_rows=st.integers(0, 40), block_m=st.sampled_from([1, 4, 16, 64]),
       absent=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_the_one_kernel_align_equals_the_torch_ops(num_pairs, num_experts, extra_rows,
                                                    block_m, absent, seed):
    """Any routing (experts repeated, absent, rows far apart): the same sorted pairs, blocks
    and padded length."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_experts + extra_rows
    ids = torch.randint(0, num_experts, (num_pairs,), generator=gen, dtype=torch.int32)
    slot_of = torch.randperm(num_rows, generator=gen)[:num_experts].to(torch.int32)
    slot_of[torch.rand(num_experts, generator=gen) < absent] = NOT_RESIDENT
    ids, slot_of = ids.to(DEVICE), slot_of.to(DEVICE)
    want = align_pairs(ids, slot_of, num_rows, block_m)
    got = align_pairs_triton(ids, slot_of, num_rows, block_m)
    assert torch.equal(got.num_padded, want.num_padded)
    assert torch.equal(got.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.block_slot, want.block_slot)
