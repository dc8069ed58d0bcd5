"""Experts read in place past the pools' slots (`ExpertRows`): the Triton kernels (under
TRITON_INTERPRET=1 without a GPU, where plain CPU tensors stand in for pinned host memory
mapped into the device's address space) take a mapped expert through the same code path as a
resident one, bit for bit."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import (
    NOT_RESIDENT,
    ExpertScales,
    MappedExpert,
    MoEKernelConfig,
    WeightFormat,
    expert_rows,
    fused_moe,
    fused_moe_triton,
    reference_fused_moe,
)
from mox.kernels.quant import INT4_GROUP128, INT8_PER_CHANNEL
from tests.kernels.problems import make_problem, quantized_pool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = MoEKernelConfig(block_m=16, block_n=32, block_k=32)       # several K steps a block
NUM_SLOTS, NUM_MAPPED = 6, 4


def _split(pool: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The first NUM_SLOTS slots stay the pool; the rest become separate allocations (pinned
    on a GPU), and the pool's own copies of them are poisoned, so a kernel that read row
    S + i at the pool's stride would see NaN (or garbage codes) rather than the expert."""
    pinned = pool.is_cuda
    mapped = [pool[s].cpu().pin_memory() if pinned else pool[s].clone()
              for s in range(NUM_SLOTS, pool.shape[0])]
    if pool.is_floating_point():
        pool[NUM_SLOTS:] = float("nan")
    else:
        pool[NUM_SLOTS:] = 0x7F
    return pool[:NUM_SLOTS], mapped


def _problem(dtype: torch.dtype, num_tokens: int):
    """Eight experts over ten rows: six in the pools' slots, four mapped, one not resident."""
    x, w13, w2, weights, ids, slot_of = make_problem(
        num_tokens, 96, 40, 8, 2, NUM_SLOTS + NUM_MAPPED, dtype, seed=3, num_missing=1)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)] + [slot_of.to(DEVICE)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_mapped_experts_compute_as_resident_ones(dtype, num_tokens):
    x, w13, w2, weights, ids, slot_of = _problem(dtype, num_tokens)
    assert (slot_of[ids.long()] >= NUM_SLOTS).any()         # some routed experts are mapped
    want = fused_moe_triton(x, w13, w2, weights, ids, slot_of, config=TILES)   # all resident
    pool13, mapped13 = _split(w13)
    pool2, mapped2 = _split(w2)
    rows = expert_rows(pool13, pool2, mapped=tuple(
        MappedExpert(a, b) for a, b in zip(mapped13, mapped2)))
    assert rows.num_rows == NUM_SLOTS + NUM_MAPPED
    got = fused_moe_triton(x, pool13, pool2, weights, ids, slot_of, config=TILES, rows=rows)
    assert torch.equal(got, want)
    # and the public entry point takes the same rows
    assert torch.equal(fused_moe(x, pool13, pool2, weights, ids, slot_of, backend="triton",
                                 rows=rows), fused_moe_triton(x, pool13, pool2, weights, ids,
                                                              slot_of, rows=rows))


@pytest.mark.parametrize("fmt", [pytest.param(INT8_PER_CHANNEL, id="int8"),
                                 pytest.param(INT4_GROUP128, id="int4")])
def test_mapped_quantized_experts_bring_their_scales(fmt: WeightFormat):
    x, w13, w2, weights, ids, slot_of = (t.cpu() for t in _problem(torch.float32, 5))
    assert (slot_of[ids.long()] >= NUM_SLOTS).any()
    data13, data2, scales = quantized_pool(w13, w2, fmt)
    on = lambda t: t.to(DEVICE)                                            # noqa: E731
    full = ExpertScales(fmt, on(scales.w13), on(scales.w2))
    want = fused_moe_triton(on(x), on(data13), on(data2), on(weights), on(ids), on(slot_of),
                            config=TILES, scales=full)
    pool13, mapped13 = _split(on(data13))
    pool2, mapped2 = _split(on(data2))
    pool_s13, mapped_s13 = _split(full.w13)
    pool_s2, mapped_s2 = _split(full.w2)
    pools = ExpertScales(fmt, pool_s13, pool_s2)
    rows = expert_rows(pool13, pool2, pools, mapped=tuple(
        MappedExpert(*parts) for parts in zip(mapped13, mapped2, mapped_s13, mapped_s2)))
    got = fused_moe_triton(on(x), pool13, pool2, on(weights), on(ids), on(slot_of),
                           config=TILES, scales=pools, rows=rows)
    assert torch.equal(got, want)


def test_without_rows_the_slots_are_the_row_space():
    """The default rows are the pools' slots, at their strides (aligned for vector loads)."""
    x, w13, w2, weights, ids, slot_of = _problem(torch.float32, 3)
    rows = expert_rows(w13, w2)
    assert rows.num_rows == w13.shape[0] and not rows.mapped and rows.aligned
    assert rows.w13.tolist() == [s * w13.stride(0) for s in range(w13.shape[0])]
    got = fused_moe_triton(x, w13, w2, weights, ids, slot_of, config=TILES, rows=rows)
    torch.testing.assert_close(got, reference_fused_moe(x, w13, w2, weights, ids, slot_of),
                               atol=1e-5, rtol=1e-5)


def test_a_mapped_expert_not_laid_out_as_a_slot_is_refused():
    _, w13, w2, *_ = _problem(torch.float32, 1)
    good = MappedExpert(w13[0].clone(), w2[0].clone())
    for bad, words in [
        (MappedExpert(w13[0].clone().t().contiguous().t(), w2[0].clone()), "strides"),
        (MappedExpert(w13[0, :10].clone(), w2[0].clone()), "laid out as a slot"),
        (MappedExpert(w13[0].clone(), w2[0].double()), "torch.float64"),
    ]:
        with pytest.raises(ValueError, match="mapped expert 1") as error:
            expert_rows(w13, w2, mapped=(good, bad))
        assert words in str(error.value)
    with pytest.raises(ValueError, match="no s13"):
        expert_rows(w13, w2, ExpertScales(WeightFormat("int8"), torch.ones(w13.shape[0], 2, 1, 1),
                                          torch.ones(w2.shape[0], 1, 1)), mapped=(good,))


def test_the_torch_path_refuses_mapped_experts():
    x, w13, w2, weights, ids, slot_of = (t.cpu() for t in _problem(torch.float32, 2))
    rows = expert_rows(w13[:NUM_SLOTS], w2[:NUM_SLOTS], mapped=tuple(
        MappedExpert(w13[s].clone(), w2[s].clone()) for s in range(NUM_SLOTS, w13.shape[0])))
    with pytest.raises(ValueError, match="Triton path only"):
        fused_moe(x, w13[:NUM_SLOTS], w2[:NUM_SLOTS], weights, ids, slot_of, backend="torch",
                  rows=rows)
    slot_of[slot_of >= NUM_SLOTS] = NOT_RESIDENT           # (no rows: the torch path serves)
    torch.testing.assert_close(
        fused_moe(x, w13[:NUM_SLOTS], w2[:NUM_SLOTS], weights, ids, slot_of, backend="torch"),
        reference_fused_moe(x, w13[:NUM_SLOTS], w2[:NUM_SLOTS], weights, ids, slot_of))
