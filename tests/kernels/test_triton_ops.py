"""The fused Triton ops of a GPU decode step (kernels/triton_ops.py) against the torch paths
they replace (mox.models.layers.rms_norm's, mox.models.rotary plus KVStore.write), under the
interpreter (whose bf16 rounding truncates: bf16 results are checked to an ulp): odd widths,
partial and interleaved rotary dims, GQA, heads that are views of one qkv row, and slots
scattered over the store."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import softmax_topk, triton_ops
from mox.loaders.rope import RopeSpec
from mox.models.layers import rms_norm
from mox.models.rotary import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # (the CPU: the interpreter)


def _torch_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 24, 100])
def test_rms_norm_equals_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(5, width, generator=gen) * 3).to(DEVICE, dtype)
    weight = torch.randn(width, generator=gen).to(DEVICE, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6),
                               _torch_rms_norm(x, weight, 1e-6), **tol)
    residual = torch.randn(5, width, generator=gen).to(DEVICE, dtype)
    summed, normed = triton_ops.rms_norm(x, weight, 1e-6, residual=residual)
    # (rounded as torch's add on a GPU; the interpreter truncates to bf16: one ulp apart)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0 if dtype == torch.float32
                               else 2 ** -7)
    torch.testing.assert_close(normed, _torch_rms_norm(x + residual, weight, 1e-6), **tol)


def test_rms_norm_of_a_strided_view_reads_its_rows():
    x = torch.randn(4, 64, device=DEVICE)[:, :48]           # rows 64 apart
    weight = torch.randn(48, device=DEVICE)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-5),
                               _torch_rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def _rope(rotary_dim: int, interleaved: bool) -> RopeSpec:
    return RopeSpec(theta=10000.0, rotary_dim=rotary_dim, interleaved=interleaved)


@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim, interleaved", [
    (4, 2, 16, 16, False),        # GQA, full rotary, halves
    (2, 2, 24, 8, False),         # partial rotary (GLM-style), dims past it kept
    (3, 1, 16, 16, True),         # interleaved pairs (DeepSeek-style)
])
def test_rope_kv_equals_rotating_then_writing(heads, kv_heads, head_dim, rotary_dim,
                                              interleaved):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    rotary = Rotary(_rope(rotary_dim, interleaved), torch.device(DEVICE))
    tokens, slots_total = 5, 40
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(DEVICE)         # one row per token
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 7, 3, 300, 12], device=DEVICE)
    slots = torch.tensor([5, 0, 33, 17, 39], device=DEVICE)
    tables = rotary.tables(positions, int(positions.max()))
    want_q, want_k = rotary.apply(q, k, tables)
    want_keys = torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(DEVICE)
    want_values = torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(DEVICE)
    keys, values = want_keys.clone(), want_values.clone()
    want_keys[slots], want_values[slots] = want_k, v
    got_q = triton_ops.rope_kv(q, k, v, rotary.cos, rotary.sin, positions, rotary_dim,
                               interleaved, keys, values, slots)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, want_keys, atol=1e-5, rtol=1e-5)   # others untouched
    assert torch.equal(values, want_values)
    # from fixed anchors and offsets to the store (a CUDA-graphed step: KVAnchor)
    anchored_keys, anchored_values = keys.clone().fill_(0), values.clone().fill_(0)
    anchor_k, anchor_v = torch.empty_like(keys[:1]), torch.empty_like(values[:1])
    offsets = torch.tensor([(t.data_ptr() - a.data_ptr()) // 4 for t, a in
                            ((anchored_keys, anchor_k), (anchored_values, anchor_v))],
                           device=DEVICE)
    triton_ops.rope_kv(q, k, v, rotary.cos, rotary.sin, positions, rotary_dim, interleaved,
                       anchor_k, anchor_v, slots, kv_offsets=offsets)
    assert torch.equal(anchored_keys[slots], keys[slots])
    assert torch.equal(anchored_values[slots], values[slots])


def test_the_model_norm_takes_the_triton_op_where_it_serves(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)
    kernel = triton_ops.rms_norm
    monkeypatch.setattr(triton_ops, "rms_norm",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    x, weight = torch.randn(3, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), _torch_rms_norm(x, weight, 1e-6),
                               atol=1e-5, rtol=1e-5)
    assert calls == [1]


@pytest.mark.parametrize("experts, k, renormalize, scaling", [
    (8, 2, False, 1.0), (60, 4, True, 1.0), (64, 8, True, 2.5), (5, 5, False, 1.0)])
def test_softmax_topk_equals_the_torch_routing(experts, k, renormalize, scaling):
    gen = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(19, experts, generator=gen)
    logits[3] = 0.5                                  # a row of ties: the lowest ids, in order
    logits[4, : experts // 2] = logits[4, experts // 2: 2 * (experts // 2)]   # pairs tie
    logits = logits.to(torch.bfloat16).to(DEVICE)    # (bf16 logits tie often)
    want_w, want_ids = softmax_topk(logits, k, renormalize)
    mark = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    got_w, got_ids = triton_ops.softmax_topk(logits, k, renormalize, scaling, mark=mark)
    assert torch.equal(got_ids, want_ids) and got_ids.dtype == torch.int32
    torch.testing.assert_close(got_w, want_w * scaling, atol=1e-6, rtol=1e-5)
    chosen = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    chosen[want_ids.reshape(-1).long()] = 1
    assert torch.equal(mark, chosen)


@pytest.mark.filterwarnings("ignore:invalid value encountered")     # (inf - inf: NaN rows)
def test_softmax_topk_of_nan_and_minus_inf_rows_stays_in_range():
    """As the torch routing: a row with a NaN logit (all its probabilities NaN) takes the
    lowest ids, and a row with fewer than k finite logits the lowest remaining ones, each
    once: every id names an expert."""
    logits = torch.full((3, 6), float("-inf"))
    logits[0, 3] = 1.0                                    # one finite logit, k = 4
    logits[1] = float("nan")
    logits[2, 4] = float("nan")
    logits[2, :3] = torch.tensor([0.5, 2.0, 1.0])
    logits = logits.to(DEVICE)
    _, want_ids = softmax_topk(logits, 4, False)
    mark = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    _, ids = triton_ops.softmax_topk(logits, 4, False, mark=mark)
    assert ids[0].tolist() == [3, 0, 1, 2]
    assert ids[1].tolist() == ids[2].tolist() == [0, 1, 2, 3]
    assert torch.equal(ids, want_ids)
    assert mark.tolist() == [1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("experts, n_group, topk_group, k, bias, renormalize", [
    (32, 4, 2, 4, True, True), (64, 8, 4, 8, True, False), (16, 1, 1, 3, False, True)])
def test_sigmoid_grouped_topk_equals_the_torch_routing(experts, n_group, topk_group, k, bias,
                                                       renormalize):
    """The same experts (the torch path's order is unspecified) with the same weights, and
    the experts chosen marked."""
    from mox.kernels import sigmoid_grouped_topk
    gen = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(19, experts, generator=gen).to(DEVICE)
    correction = (0.1 * torch.randn(experts, generator=gen)).to(DEVICE) if bias else None
    want_w, want_ids = sigmoid_grouped_topk(logits, k, correction, n_group, topk_group,
                                            renormalize, 2.5)
    mark = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    got_w, got_ids = triton_ops.sigmoid_grouped_topk(logits, k, correction, n_group,
                                                     topk_group, renormalize, 2.5, mark=mark)
    assert got_ids.dtype == torch.int32
    order_got, order_want = got_ids.sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices),
                               want_w.gather(1, order_want.indices), atol=1e-6, rtol=1e-5)
    chosen = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    chosen[want_ids.reshape(-1).long()] = 1
    assert torch.equal(mark, chosen)
