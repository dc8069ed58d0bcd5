"""Quantized experts (mox.kernels.quant): the formats' round trip, and every MoE backend over
quantized slot pools against the one reference (the fp32 definition over the dequantized
weights), at odd shapes: T = 1 and 19, H and I not multiples of the block, experts absent
from the slot map."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import (
    ExpertScales,
    MoEKernelConfig,
    fused_moe,
    fused_moe_triton,
    native,
    reference_fused_moe,
)
from mox.kernels.quant import (
    FP8,
    FP8_BLOCK128,
    INT4_GROUP128,
    INT8_PER_CHANNEL,
    MXFP4_GROUP32,
    WeightFormat,
    dequantize,
    dequantize_experts,
    pack_int4,
    quantize,
    unpack_int4,
)
from tests.kernels.problems import make_problem, quantized_pool

FORMATS = [pytest.param(INT8_PER_CHANNEL, id="int8"), pytest.param(INT4_GROUP128, id="int4"),
           pytest.param(FP8_BLOCK128, id="fp8-block"),
           pytest.param(WeightFormat(FP8), id="fp8-channel"),
           pytest.param(MXFP4_GROUP32, id="mxfp4")]
# the largest error a value may carry, relative to its block's largest magnitude
# (MXFP4: a power-of-two scale puts the block's largest value in (3, 6], steps of 2 above 4)
RELATIVE_STEP = {"int8": 0.5 / 127, "int4": 0.5 / 7, "fp8": 2.0**-4, "mxfp4": 1.0 / 3}
NATIVE = native.kernels()
SMALL_TILES = MoEKernelConfig(block_m=16, block_n=32, block_k=32)     # several K steps a block


def _quantized_problem(fmt, num_tokens: int, hidden: int, inter: int, num_experts: int,
                       num_slots: int, seed: int, num_missing: int):
    """A fused-MoE problem over a quantized pool: (x, weights, ids, slot_of), the stored
    pool (data13, data2, scales) and its dequantized values (dq13, dq2) for the reference."""
    x, w13, w2, weights, ids, slot_of = make_problem(num_tokens, hidden, inter, num_experts,
                                                     k=2, num_slots=num_slots,
                                                     dtype=torch.float32, seed=seed,
                                                     num_missing=num_missing)
    data13, data2, scales = quantized_pool(w13, w2, fmt)
    dq13, dq2 = dequantize_experts(data13, data2, scales, torch.arange(num_slots),
                                   torch.float32)
    return (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, cols", [(1, 2), (200, 72), (128, 256), (131, 390)])
def test_round_trip_error_is_within_half_a_step(fmt, rows, cols):
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    data, scale = quantize(weight, fmt)
    assert data.dtype == fmt.storage_dtype and data.shape == fmt.stored_shape(rows, cols)
    assert tuple(scale.shape) == fmt.scale_shape(rows, cols)
    values = dequantize(data, scale, fmt)
    bound = weight.abs().max() * RELATIVE_STEP[fmt.kind] * 1.01
    assert (values - weight).abs().max() <= bound
    # one row's scale only bounds that row: a row of zeros stays zeros
    zeros = torch.zeros(rows, cols)
    assert torch.equal(dequantize(*quantize(zeros, fmt), fmt), zeros)


def test_int4_packing_is_low_nibble_first_and_inverts():
    values = torch.tensor([[-8, 7, 0, -1, 3, -5]], dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.tolist() == [[0xF0, 0x78, 0x3B]]          # value + 8, first in the low nibble
    assert torch.equal(unpack_int4(packed), values)


def test_int4_bytes_are_compressed_tensors_packed_int32():
    """compressed-tensors' pack-quantized: each int32 holds 8 values + 8, value i in bits
    4i..4i+3, stored little-endian; mox's uint8 pairs are those bytes."""
    values = torch.tensor([[-8, 7, 0, -1, 3, -5, 2, 1, 6, -7, -2, 4, 5, -3, -6, -4]])
    words = [sum((int(v) + 8) << (4 * i) for i, v in enumerate(values[0, j:j + 8]))
             for j in (0, 8)]
    expected = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]],
                            dtype=torch.int32)
    assert torch.equal(pack_int4(values).view(torch.int32), expected)


def test_fp8_block_scales_multiply():
    """DeepSeek's `weight_scale_inv`, despite its name, multiplies the stored values."""
    data = torch.tensor([[1.5, -2.0], [0.25, 448.0]]).to(torch.float8_e4m3fn)
    values = dequantize(data, torch.tensor([[3.0]]), FP8_BLOCK128)
    assert torch.equal(values, data.float() * 3.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_over_quantized_pools_matches_the_reference(fmt, num_tokens, dtype):
    hidden, inter = (160, 72) if fmt.block_rows > 1 or fmt.block_cols else (96, 64)
    (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2) = _quantized_problem(
        fmt, num_tokens, hidden, inter, num_experts=8, num_slots=10, seed=num_tokens,
        num_missing=2)
    want = reference_fused_moe(x.to(dtype), dq13, dq2, weights, ids, slot_of).float()
    got = fused_moe(x.to(dtype), data13, data2, weights, ids, slot_of, scales=scales,
                    out_dtype=torch.float32)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2,
                                                                               atol=3e-2)
    torch.testing.assert_close(got, want, **tolerance)


NATIVE_FORMATS = [pytest.param(INT8_PER_CHANNEL, id="int8"),
                  pytest.param(INT4_GROUP128, id="int4-g128"),
                  pytest.param(WeightFormat("int4", 1, 64), id="int4-g64"),
                  pytest.param(WeightFormat("int4", 1, 32), id="int4-g32"),
                  pytest.param(MXFP4_GROUP32, id="mxfp4"),
                  pytest.param(FP8_BLOCK128, id="fp8-b128", marks=pytest.mark.skipif(
                      NATIVE is None or not NATIVE.fast, reason="no vector native kernels"))]


@pytest.mark.skipif(NATIVE is None or not NATIVE.fast,
                    reason="no vector native kernels (AVX2 or AVX-512)")
@pytest.mark.parametrize("fmt", NATIVE_FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_quantized_decode_takes_the_native_kernel_and_matches(fmt, num_tokens, monkeypatch):
    hidden, inter = 256, 128
    (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2) = _quantized_problem(
        fmt, num_tokens, hidden, inter, num_experts=8, num_slots=8, seed=3, num_missing=1)
    want = reference_fused_moe(x.bfloat16(), dq13, dq2, weights, ids, slot_of).float()
    calls = []
    original = NATIVE.moe_experts
    monkeypatch.setattr(NATIVE, "moe_experts", lambda *a, **kw: calls.append(1) or original(
        *a, **kw))
    got = fused_moe(x.bfloat16(), data13, data2, weights, ids, slot_of, scales=scales,
                    out_dtype=torch.float32)
    assert calls, "quantized decode did not take the native kernel"
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(NATIVE is None or not NATIVE.fast,
                    reason="no vector native kernels (AVX2 or AVX-512)")
@pytest.mark.parametrize("fmt", NATIVE_FORMATS)
def test_the_native_moe_block_over_quantized_pools_equals_fused_moe(fmt):
    """The decode block (csrc/moe_block.c) hands quantized pools (their scales, groups and
    part rows) to the kernel as fused_moe does: the same bits for the routing it chose."""
    from mox.kernels.native_moe import moe_layer

    hidden, inter, num_experts = 256, 128, 8
    (x, _, _, slot_of), (data13, data2, scales), _ = _quantized_problem(
        fmt, 5, hidden, inter, num_experts=num_experts, num_slots=10, seed=4, num_missing=0)
    h, residual = x.bfloat16(), torch.randn(5, hidden).bfloat16()
    router = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(5))
    layer = moe_layer(router.bfloat16(), None, inter, 2, "softmax_topk", True, 1.0)
    weights, ids, out = NATIVE.moe_block(layer, h, slot_of.to(torch.int32), data13, data2,
                                         scales, residual=residual)
    want = fused_moe(h, data13, data2, weights, ids, slot_of, scales=scales,
                     out_dtype=torch.float32)
    assert out is not None and torch.equal(out, residual + want.bfloat16())


@pytest.fixture
def int8pack_calls(monkeypatch) -> list[int]:
    """A 1 for every call of torch's int8 weight-only GEMM."""
    calls: list[int] = []
    original = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm",
                        lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="torch lacks it")
def test_int8_prefill_rows_take_torchs_int8_gemm_and_match(monkeypatch, int8pack_calls):
    hidden, inter = 128, 64
    (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2) = _quantized_problem(
        INT8_PER_CHANNEL, 64, hidden, inter, num_experts=4, num_slots=6, seed=7,
        num_missing=1)                                                   # ~40 rows an expert
    want = reference_fused_moe(x.bfloat16(), dq13, dq2, weights, ids, slot_of).float()
    if NATIVE is not None:            # rows past the native kernel's limit (AVX2 has none)
        monkeypatch.setitem(native.MAX_ROWS_PER_EXPERT, NATIVE.isa, 16)
    got = fused_moe(x.bfloat16(), data13, data2, weights, ids, slot_of, scales=scales,
                    out_dtype=torch.float32)
    assert int8pack_calls, "int8 prefill rows did not take torch's int8 GEMM"
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not hasattr(torch, "_weight_int8pack_mm"), reason="torch lacks it")
def test_int8_rows_torchs_int8_gemm_cannot_take_are_dequantized(int8pack_calls):
    """Rows whose length (hidden 200, inter 72) is not a multiple of 16: torch's int8 GEMM
    read past them and killed the process (SIGSEGV) from two rows on."""
    (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2) = _quantized_problem(
        INT8_PER_CHANNEL, 19, 200, 72, num_experts=8, num_slots=10, seed=3, num_missing=2)
    want = reference_fused_moe(x.bfloat16(), dq13, dq2, weights, ids, slot_of).float()
    got = fused_moe(x.bfloat16(), data13, data2, weights, ids, slot_of, scales=scales,
                    out_dtype=torch.float32)
    assert not int8pack_calls
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(NATIVE is None, reason="no C compiler to build the kernels")
@pytest.mark.parametrize("fmt", [pytest.param(INT8_PER_CHANNEL, id="int8"),
                                 pytest.param(INT4_GROUP128, id="int4-g128"),
                                 pytest.param(WeightFormat("int4", 1, 256), id="int4-g256"),
                                 pytest.param(WeightFormat("int4", 1, 64), id="int4-g64"),
                                 pytest.param(WeightFormat("int4", 1, 32), id="int4-g32"),
                                 pytest.param(MXFP4_GROUP32, id="mxfp4"),
                                 pytest.param(WeightFormat("fp8", 32, 32), id="fp8-b32"),
                                 pytest.param(WeightFormat("fp8", 48, 32), id="fp8-b48x32"),
                                 pytest.param(WeightFormat("fp8"), id="fp8-channel")])
@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None or not NATIVE.fast, reason="this CPU has no AVX2"))])
def test_native_quantized_experts_match_the_dequantized_definition(fmt, fast):
    """Against the definition with the kernel's activation quantization (int8, one scale per
    64 values, round half to even) applied to its inputs (FP8 meets bf16 activations as they
    are). int4 in groups of 128 or more takes its own loop on VNNI (two blocks a load)."""
    hidden, inter, counts, slots = 128, 64, [2, 1, 9], [4, 0, 2]   # (48-row blocks: ragged)
    if fmt.block_cols >= 128:
        hidden, inter = 2 * fmt.block_cols, fmt.block_cols
    x, w13, w2, *_ = make_problem(1, hidden, inter, 4, 2, num_slots=5, dtype=torch.float32)
    data13, data2, scales = quantized_pool(w13, w2, fmt)
    num_rows = sum(counts)
    rows = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    row_weights = torch.rand(num_rows, generator=torch.Generator().manual_seed(5))
    scratch = [torch.empty(num_rows, 2 * inter), torch.empty(num_rows, inter,
                                                             dtype=torch.bfloat16),
               torch.empty(num_rows, hidden)]
    threads = torch.get_num_threads()
    try:                # one thread: the first expert is claimed whole (moe_experts.c's
        torch.set_num_threads(1)        # TAIL_PER_THREAD), the last two shared in chunks
        one = NATIVE.moe_experts(rows, data13, data2, list(zip(slots, counts)), row_weights,
                                 scratch, fast=fast, scales=scales).clone()
    finally:
        torch.set_num_threads(threads)
    got = NATIVE.moe_experts(rows, data13, data2, list(zip(slots, counts)), row_weights,
                             scratch, fast=fast, scales=scales)
    assert torch.equal(one, got)        # (each output sums the same terms in the same order)
    dq13, dq2 = dequantize_experts(data13, data2, scales, torch.arange(5), torch.float32)
    slot_of_row = torch.repeat_interleave(torch.tensor(slots), torch.tensor(counts))
    activations = (lambda t: t.float()) if fmt.kind == "fp8" else _int8_blocks
    gate_up = torch.einsum("ph,pnh->pn", activations(rows), dq13[slot_of_row])
    act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).bfloat16()
    want = torch.einsum("pi,phi->ph", activations(act), dq2[slot_of_row]) * row_weights[:, None]
    # (a value at a rounding tie may land one step apart: ~1e-3 a tie at these sizes, more
    # ties with more values)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=5e-3 * inter / 64)


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` as the native kernel quantizes activations, dequantized: f32."""
    blocks = x.float().view(x.shape[0], -1, native.QUANT_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127.0)).view(x.shape)


@pytest.mark.parametrize("fmt", FORMATS + [pytest.param(WeightFormat("int4", 1, 32),
                                                         id="int4-g32")])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_triton_dequantizes_inside_the_k_loop(fmt, num_tokens, monkeypatch):
    """The Triton kernels over quantized pools (TRITON_INTERPRET=1 without a GPU): H and I
    cross block edges, tiles smaller than the scale blocks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    hidden, inter = 160, 72
    (x, weights, ids, slot_of), (data13, data2, scales), (dq13, dq2) = _quantized_problem(
        fmt, num_tokens, hidden, inter, num_experts=8, num_slots=10, seed=5, num_missing=2)
    want = reference_fused_moe(x, dq13, dq2, weights, ids, slot_of)
    on = lambda t: t.to(device)
    got = fused_moe_triton(on(x), on(data13), on(data2), on(weights), on(ids), on(slot_of),
                           config=SMALL_TILES,
                           scales=ExpertScales(fmt, on(scales.w13), on(scales.w2)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(NATIVE is None, reason="no C compiler to build the kernels")
@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None or not NATIVE.fast, reason="this CPU has no AVX2"))])
def test_fp8_bytes_decode_as_torchs_e4m3(fast):
    """Every E4M3 byte but NaN (subnormals, both signs, the largest): a one-hot row reads one
    column of the pool, so the kernel's gate_up scratch holds the weights as it decoded
    them, against torch.float8_e4m3fn's values."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    inter, hidden = 128, 64                                  # 2I = 256 rows >= 254 codes
    column = torch.zeros(2 * inter, dtype=torch.uint8)
    column[:codes.numel()] = codes
    data13 = torch.zeros(1, 2 * inter, hidden, dtype=torch.uint8)
    data13[0, :, 5] = column
    fmt = WeightFormat("fp8")
    scales = ExpertScales(fmt, torch.ones(1, 2, inter, 1), torch.ones(1, hidden, 1))
    rows = torch.zeros(1, hidden, dtype=torch.bfloat16)
    rows[0, 5] = 1.0
    scratch = [torch.empty(1, 2 * inter), torch.empty(1, inter, dtype=torch.bfloat16),
               torch.empty(1, hidden)]
    NATIVE.moe_experts(rows, data13.view(torch.float8_e4m3fn),
                       torch.zeros(1, hidden, inter, dtype=torch.float8_e4m3fn), [(0, 1)],
                       torch.ones(1), scratch, fast=fast, scales=scales)
    want = column.view(torch.float8_e4m3fn).float()
    assert torch.equal(scratch[0][0, :codes.numel()], want[:codes.numel()])
