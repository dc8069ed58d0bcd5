"""The native CPU decode kernels (kernels/csrc/bf16_gemv.c) against fp32 references: the
matrix-vector products and the fused SiLU experts, on both of the library's paths (the
AVX512-BF16 or AVX2 one runs where the CPU has it; the plain-C one everywhere), and the fused-MoE
entry point with and without them."""

from __future__ import annotations

import os

import pytest
import torch

from mox.kernels import moe_torch, native, native_build
from mox.kernels.activation import CLAMPED_SWIGLU, SILU, Activation
from mox.kernels.moe_reference import reference_fused_moe
from mox.kernels.moe_torch import fused_moe_torch
from mox.loaders.rope import RopeSpec
from mox.models.rotary import Rotary

NATIVE = native.kernels()
# the plain-C path, and the vector path this CPU has (AVX512-BF16, or AVX2 + FMA)
PATHS = [pytest.param(False, id="plain"),
         pytest.param(True, id="vector", marks=pytest.mark.skipif(
             NATIVE is None or not NATIVE.fast, reason="this CPU has no AVX2 + FMA"))]
pytestmark = pytest.mark.skipif(NATIVE is None, reason="no C compiler to build the kernels")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("fast", PATHS)
# (rows and weight rows past multiples of the AVX2 tiles' 3: 4 and 7 rows end in 2 + 2;
# 257 and 1030 weight rows: claims of columns, the last one short and not a whole tile; one
# and two rows: a weight row at a time on AVX2. With AMX, from 8 rows: one tile of x rows up
# to 16 and two up to 32, more in groups of 32 (33, 64); weight rows in blocks of 32, the rest
# of a claim (50, 70, 1030) on AVX512-BF16)
@pytest.mark.parametrize("rows, n, k", [(1, 1, 32), (1, 1000, 1024), (2, 70, 160), (3, 257, 96),
                                        (8, 64, 512), (5, 33, 4096), (4, 4, 64),
                                        (7, 11, 192), (32, 50, 256), (32, 1030, 64),
                                        (16, 32, 32), (17, 70, 96), (33, 100, 64),
                                        (64, 1030, 128)])
def test_gemv_matches_fp32(fast, rows, n, k):
    x, w = _bf16(rows, k, seed=1), _bf16(n, k, seed=2)
    got = NATIVE.gemv(x, w, fast=fast)
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * k ** 0.5)
    rounded = NATIVE.gemv(x, w, out_dtype=torch.bfloat16, fast=fast)   # the sums, rounded once
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())


@pytest.mark.parametrize("fast", PATHS)
def test_gemv_reads_strided_rows_and_refuses_what_it_cannot_take(fast):
    x = _bf16(6, 128, seed=3)[:, :64]                  # rows 128 apart, 64 used
    w = _bf16(20, 64, seed=4)
    many = _bf16(20, 128, seed=3)[:, :64]              # ... and as AMX tiles
    tall = _bf16(40, 64, seed=4)
    torch.testing.assert_close(NATIVE.gemv(many, tall, fast=fast),
                               many.float() @ tall.float().t(), rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(NATIVE.gemv(x, w, fast=fast), x.float() @ w.float().t(),
                               rtol=1e-4, atol=1e-2)
    wide = _bf16(20, 96, seed=6)[:, 32:]               # weight rows 96 apart (the tiles'
    torch.testing.assert_close(NATIVE.gemv(x, wide, fast=fast),  # prefetches: per row)
                               x.float() @ wide.float().t(), rtol=1e-4, atol=1e-2)
    with pytest.raises(ValueError):
        NATIVE.gemv(_bf16(1025, 64, seed=5), w, fast=fast)       # more rows than it takes
    with pytest.raises(ValueError):
        NATIVE.gemv(x.float(), w.float(), fast=fast)


def _experts(num_slots: int, hidden: int, inter: int):
    return _bf16(num_slots, 2 * inter, hidden, seed=6) * 0.1, _bf16(
        num_slots, hidden, inter, seed=7) * 0.1


@pytest.mark.parametrize("fast", PATHS)
# eight experts: the first claimed whole, the last TAIL_PER_THREAD per thread (moe_experts.c)
# in chunks of rows; H and I not multiples of the chunk, so the last claims are short
@pytest.mark.parametrize("counts", [[1], [2, 1, 3], [9, 1], [17, 4, 1, 1],
                                    [1, 2, 1, 1, 6, 1, 1, 1]])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-swiglu-biases"])
def test_moe_experts_matches_the_reference(fast, counts, gpt_oss):
    hidden, inter, num_slots = 192, 160, 9
    w13, w2 = _experts(num_slots, hidden, inter)
    activation = Activation(CLAMPED_SWIGLU, limit=0.5) if gpt_oss else Activation(SILU)
    b13, b2 = ((_bf16(num_slots, 2 * inter, seed=10), _bf16(num_slots, hidden, seed=11))
               if gpt_oss else (None, None))
    slots = [5, 0, 3, 2, 8, 1, 7, 4][:len(counts)]
    num_rows = sum(counts)
    rows = _bf16(num_rows, hidden, seed=8)
    weights = torch.rand(num_rows, generator=torch.Generator().manual_seed(9))
    runs = list(zip(slots, counts))
    scratch = [torch.empty(num_rows, 2 * inter), torch.empty(num_rows, inter,
                                                             dtype=torch.bfloat16),
               torch.empty(num_rows, hidden)]
    got = NATIVE.moe_experts(rows, w13, w2, runs, weights, scratch, fast=fast,
                             activation=activation, b13=b13, b2=b2)
    slot_of_row = torch.repeat_interleave(torch.tensor(slots), torch.tensor(counts))
    gate_up = torch.einsum("ph,pnh->pn", rows.float(), w13[slot_of_row].float())
    if gpt_oss:                  # (a limit of 0.5 clamps a good share of these values)
        gate_up += b13[slot_of_row].float()
    act = activation(gate_up[:, :inter], gate_up[:, inter:]).bfloat16()
    down = torch.einsum("pi,phi->ph", act.float(), w2[slot_of_row].float())
    if gpt_oss:
        down += b2[slot_of_row].float()
    torch.testing.assert_close(got, down * weights[:, None], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-swiglu"])
def test_a_gate_far_below_zero_activates_to_zero(fast, gpt_oss):
    """SiLU(gate) for a gate of -2^126: exp(-gate) overflows to inf and the activation is -0,
    as torch's; an exp that saturates short of inf (at 2.4e38) gave -0.35 here."""
    hidden = inter = 32
    rows = torch.zeros(1, hidden, dtype=torch.bfloat16)
    rows[0, 0] = 2.0 ** 63
    w13 = torch.zeros(1, 2 * inter, hidden, dtype=torch.bfloat16)
    w13[0, :inter, 0] = -(2.0 ** 63)                 # every gate -2^126
    w13[0, inter:, 0] = 2.0 ** -63                   # every up 1
    w2 = torch.full((1, hidden, inter), 0.01, dtype=torch.bfloat16)
    activation = Activation(CLAMPED_SWIGLU, limit=7.0) if gpt_oss else Activation(SILU)
    scratch = [torch.empty(1, 2 * inter), torch.empty(1, inter, dtype=torch.bfloat16),
               torch.empty(1, hidden)]
    got = NATIVE.moe_experts(rows, w13, w2, [(0, 1)], torch.ones(1), scratch, fast=fast,
                             activation=activation)
    want = activation(torch.full((1, inter), -(2.0 ** 126)), torch.ones(1, inter))
    assert torch.equal(want, torch.zeros_like(want))
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_fused_moe_with_the_native_kernels_matches_the_reference(num_tokens, monkeypatch):
    """Decode shapes take the native kernels where they serve; either way, the result is the
    fp32 definition's within bf16 rounding."""
    hidden, inter, num_experts, k = 64, 96, 8, 2
    w13, w2 = _experts(num_experts, hidden, inter)
    x = _bf16(num_tokens, hidden, seed=10)
    gen = torch.Generator().manual_seed(11)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k]
                            for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, k, generator=gen)
    slot_of = torch.tensor([3, 1, -1, 0, 7, 6, 5, 2])            # expert 2 not resident
    want = reference_fused_moe(x, w13, w2, topk_weights, topk_ids, slot_of).float()
    got = fused_moe_torch(x, w13, w2, topk_weights, topk_ids, slot_of, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)    # bf16: 2^-8 of values ~1
    monkeypatch.setattr(moe_torch.native, "kernels", lambda: None)          # torch's paths
    old = fused_moe_torch(x, w13, w2, topk_weights, topk_ids, slot_of, out_dtype=torch.float32)
    torch.testing.assert_close(old, want, rtol=2e-2, atol=1e-2)    # bf16: 2^-8 of values ~1


def test_fused_moe_with_no_expert_resident_gives_zeros():
    """Several tokens whose experts are all missing: the native path has no rows to run."""
    w13, w2 = _experts(4, 64, 96)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    slot_of = torch.full((3,), -1, dtype=torch.int32)
    got = fused_moe_torch(_bf16(3, 64, seed=12), w13, w2, torch.rand(3, 2), ids, slot_of,
                          out_dtype=torch.float32)
    assert torch.equal(got, torch.zeros(3, 64))


def test_no_compiler_means_no_native_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")                 # a compiler that always fails
    assert native_build.build(native_build.SOURCE_DIR) is None
    assert not list(tmp_path.rglob("*.so"))           # nothing half-built left behind


def test_a_compiler_without_march_native_still_builds(tmp_path, monkeypatch):
    """-march=native is tried first; a compiler that rejects it builds the portable library."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && exit 1; done\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    built = native_build.build(native_build.SOURCE_DIR)
    assert built is not None and os.path.exists(built)
    assert [p.name for p in (tmp_path / "cache").rglob("*.so")] == [os.path.basename(built)]


def test_the_cache_holds_one_library_per_cpu(tmp_path, monkeypatch):
    """Built for the CPU it runs on, so a cache shared by two CPUs keeps a library for each."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native_build, "_cpu_identity", lambda: "cpu one")
    first = native_build.build(native_build.SOURCE_DIR)
    assert native_build.build(native_build.SOURCE_DIR) == first        # cached
    monkeypatch.setattr(native_build, "_cpu_identity", lambda: "cpu two")
    second = native_build.build(native_build.SOURCE_DIR)
    assert first is not None and second is not None and first != second


def test_the_cache_holds_one_library_per_set_of_target_flags(tmp_path, monkeypatch):
    """bench/micro/native_ab builds the same sources with other flags beside the default."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tuned = native_build.build(native_build.SOURCE_DIR)
    untuned = native_build.build(native_build.SOURCE_DIR, target_flags=("-march=native",))
    assert tuned is not None and untuned is not None and tuned != untuned


def _reference_attention(q, keys, values, slots, window):
    """One token's attention over the given key rows, fp32, GQA by repetition."""
    if window is not None:
        slots = slots[-window:]
    group = q.shape[0] // keys.shape[1]
    k = keys[slots].float().repeat_interleave(group, 1).transpose(0, 1)    # [h, K, d]
    v = values[slots].float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float()[:, None, :] @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    return (torch.softmax(scores, -1) @ v)[:, 0]                             # [h, dv]


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dim", [64, 36])          # 36: past the vector loops' last whole step
@pytest.mark.parametrize("heads", [8, 10])          # groups of 4 query heads, and of 4 + 1
def test_decode_attention_reads_keys_in_place(fast, window, dim, heads):
    kv_heads = 2
    # enough tokens for a task to take a token's every KV head (4 a thread), whatever the CPU
    num_tokens = 4 * (os.cpu_count() or 1) + 1
    lengths = torch.randint(1, 18, (num_tokens,), generator=torch.Generator().manual_seed(15))
    lengths[0] = 41                 # blocks of 16 keys, and of 8 (AVX2), then a part of one
    starts = lengths.cumsum(0) - lengths
    num_slots = 2 * int(lengths.sum())
    keys, values = _bf16(num_slots, kv_heads, dim, seed=12), _bf16(num_slots, kv_heads, dim,
                                                                   seed=13)
    q = _bf16(num_tokens, heads, dim, seed=14)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(16))
    got = NATIVE.decode_attention(q, keys, values, slots, starts, lengths, dim ** -0.5, window,
                                  fast=fast)
    for t in range(num_tokens):
        mine = slots[starts[t]:starts[t] + lengths[t]]
        torch.testing.assert_close(got[t], _reference_attention(q[t], keys, values, mine, window),
                                   rtol=1e-4, atol=1e-5)
    # one token alone is split by KV head over the threads, many by token: the same sums
    t = int(lengths.argmax())
    alone = NATIVE.decode_attention(q[t:t + 1], keys, values, slots, starts[t:t + 1],
                                    lengths[t:t + 1], dim ** -0.5, window, fast=fast)
    assert torch.equal(alone[0], got[t])


def test_attend_takes_the_native_path_for_decode_and_agrees_with_torch():
    """A decode batch of three sequences over a real KVStore: the native path (key ranges,
    keys read in place) against the padded/flat torch paths, with and without a window."""
    from mox.models.attend import attend
    from mox.models.forward_batch import ForwardBatch
    from mox.models.kv_store import KVStore

    store = KVStore(1, 2, 64, torch.bfloat16, torch.device("cpu"), block_size=4)
    store.ensure_blocks(16)
    keys, values = store.rows(0)
    keys.copy_(_bf16(*keys.shape, seed=16))
    values.copy_(_bf16(*values.shape, seed=17))
    lengths = [5, 9, 2]                              # keys per sequence, the new one last
    kv_slots = torch.randperm(64, generator=torch.Generator().manual_seed(18))[:sum(lengths)]
    kv_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    kv_pos = torch.cat([torch.arange(n) for n in lengths])
    ends = torch.tensor(lengths).cumsum(0)
    batch = ForwardBatch(torch.zeros(3, dtype=torch.long), torch.tensor(lengths) - 1,
                         torch.arange(3), kv_slots[ends - 1], kv_slots, kv_seq, kv_pos, store)
    q = _bf16(3, 8, 64, seed=19)
    for window in (None, 4):
        torch_path = attend(batch, 0, q, window)
        batch.key_ranges = ends - torch.tensor(lengths), torch.tensor(lengths)
        native_path = attend(batch, 0, q, window)
        batch.key_ranges = None
        torch.testing.assert_close(native_path.float(), torch_path.float(), rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("heads", [4, 5])           # a group of four, and of four + one
def test_mla_absorbed_decode_equals_attending_over_expanded_keys(fast, heads):
    """MLA decode reading the cached latents in place (kv_b folded into the query and the
    output) against the expanded per-head keys and values the reference builds."""
    from functools import partial

    from mox.loaders.spec import MLASpec
    from mox.models.attend import attend
    from mox.models.forward_batch import ForwardBatch
    from mox.models.kv_store import KVStore
    from mox.models.mla import _expand, absorbed_decode

    # (a rotary part of 12: the vector loops' tail; 21 keys: more than one block of 16)
    mla = MLASpec(None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=12,
                  v_head_dim=32, softmax_scale=44 ** -0.5)
    store = KVStore(1, 1, 64, torch.bfloat16, torch.device("cpu"), block_size=4, value_dim=12)
    store.ensure_blocks(8)
    latents, rope_keys = store.rows(0)
    latents.copy_(_bf16(*latents.shape, seed=20))
    rope_keys.copy_(_bf16(*rope_keys.shape, seed=21))
    kv_b = _bf16(heads * (32 + 32), 64, seed=22) * 0.2
    lengths = [21, 3]
    kv_slots = torch.randperm(32, generator=torch.Generator().manual_seed(23))[:sum(lengths)]
    ends = torch.tensor(lengths).cumsum(0)
    batch = ForwardBatch(torch.zeros(2, dtype=torch.long), torch.tensor(lengths) - 1,
                         torch.arange(2), kv_slots[ends - 1], kv_slots,
                         torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)),
                         torch.cat([torch.arange(n) for n in lengths]), store)
    q_nope, q_rope = _bf16(2, heads, 32, seed=24), _bf16(2, heads, 12, seed=25)
    expanded = attend(batch, 0, torch.cat((q_nope, q_rope), -1), None,
                      scale=mla.softmax_scale, expand=partial(_expand, mla, heads, kv_b))
    batch.key_ranges = ends - torch.tensor(lengths), torch.tensor(lengths)
    absorbed = absorbed_decode(mla, kv_b, 0, q_nope, q_rope, batch, None, fast=fast)
    assert expanded.abs().mean() > 0.1                  # values of order one: the tolerance bites
    torch.testing.assert_close(absorbed.float(), expanded.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_equals_torchs(rows):
    """Bit for bit but for the order of the sum of squares: at most one bf16 step apart."""
    from mox.models import layers

    x, weight = _bf16(rows, 1024, seed=26) * 3, _bf16(1024, seed=27)
    got = NATIVE.rms_norm(x, weight, 1e-6)
    with native.torch_paths():
        want = layers.rms_norm(x, weight, 1e-6)
    step = want.float().abs() * 2 ** -7 + 1e-30              # one bf16 ulp (8-bit mantissa)
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.99


def test_an_unwritable_cache_means_no_native_kernels(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")                             # a file where the cache folder would go
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert native_build.build(native_build.SOURCE_DIR) is None


@pytest.mark.parametrize("rope", [
    RopeSpec(theta=10000.0, rotary_dim=64),                            # halves, whole head
    RopeSpec(theta=500000.0, rotary_dim=32),                           # halves, part of it
    RopeSpec(theta=10000.0, rotary_dim=64, interleaved=True),          # DeepSeek's pairs
    RopeSpec(theta=10000.0, rotary_dim=32, interleaved=True)])         # pairs, part of it
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rope_kv_equals_the_reference_rotation_and_store(rope, num_tokens):
    """Rotated q and k bit for bit as `Rotary.rotate` gives them, and k, v stored at their
    slots (the rest of the store untouched); a slot outside the store is refused unwritten."""
    heads, kv_heads, dim = 4, 2, 64
    rotary = Rotary(rope, torch.device("cpu"))
    positions = torch.arange(3, 3 + num_tokens) * 37
    tables = rotary.tables(positions, int(positions.max()))
    q, k, v = (_bf16(num_tokens, n, dim, seed=s) for s, n in ((1, heads), (2, kv_heads),
                                                               (3, kv_heads)))
    want_q, want_k = rotary.rotate(q, tables), rotary.rotate(k, tables)
    keys, values = _bf16(40, kv_heads, dim, seed=4), _bf16(40, kv_heads, dim, seed=5)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(6))[:num_tokens]
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[slots], want_values[slots] = want_k, v
    NATIVE.rope_kv(q, k, v, tables, rope.rotary_dim, rope.interleaved, keys, values, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    before = keys.clone()
    with pytest.raises(ValueError, match="outside"):
        NATIVE.rope_kv(q, k, v, tables, rope.rotary_dim, rope.interleaved, keys, values,
                       torch.full((num_tokens,), 40))
    assert torch.equal(keys, before)
