"""The Triton decode attention (under TRITON_INTERPRET=1 without a GPU) against the softmax over
each token's keys gathered from the store: GQA, odd head dims, sliding windows, keys spread
over scattered slots and several blocks."""

from __future__ import annotations

import pytest
import torch

from mox.kernels.attention_triton import decode_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _problem(dtype: torch.dtype, dim: int, value_dim: int, lengths: list[int], seed: int = 0,
             heads: int = 8, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 128
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    keys = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(num_slots, kv_heads, value_dim, generator=gen).to(dtype)
    # each token's keys: a run of scattered slots (a paged store's blocks, shuffled)
    slots = torch.cat([torch.randperm(num_slots, generator=gen)[:n] for n in lengths])
    lengths_t = torch.tensor(lengths)
    starts = lengths_t.cumsum(0) - lengths_t
    return q, keys, values, slots, starts, lengths_t


def _reference(q, keys, values, slots, starts, lengths, scale, window):
    group = q.shape[1] // keys.shape[1]
    out = []
    for t in range(q.shape[0]):
        first = max(0, int(lengths[t]) - window) if window else 0
        run = slots[int(starts[t]) + first:int(starts[t]) + int(lengths[t])]
        k = keys[run].float().repeat_interleave(group, dim=1)            # [n, h, d]
        v = values[run].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim,value_dim", [(32, 32), (24, 40)])
@pytest.mark.parametrize("window", [None, 6])
def test_triton_decode_attention_matches_the_gathered_softmax(dtype, atol, dim, value_dim,
                                                              window):
    args = _problem(dtype, dim, value_dim, lengths=[1, 7, 33, 70, 5])
    want = _reference(*args, scale=dim ** -0.5, window=window)
    got = decode_attention_triton(*(a.to(DEVICE) for a in args), scale=dim ** -0.5,
                                  window=window, block_n=16)        # several blocks a token
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (16, 2)])   # groups 1, 3, 8
def test_any_group_of_query_heads_per_kv_head(heads, kv_heads):
    """Groups padded to a power of two (1 -> 2, 3 -> 4) and the default block of keys."""
    args = _problem(torch.float32, 32, 32, lengths=[2, 40], heads=heads, kv_heads=kv_heads)
    want = _reference(*args, scale=0.2, window=None)
    got = decode_attention_triton(*(a.to(DEVICE) for a in args), scale=0.2, window=None)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_heads_that_do_not_share_kv_heads_evenly_are_refused():
    q, keys, values, slots, starts, lengths = _problem(torch.float32, 32, 32, [3])
    with pytest.raises(ValueError, match="h=6 over h_kv=4"):
        decode_attention_triton(q[:, :6], keys.repeat(1, 2, 1), values.repeat(1, 2, 1), slots,
                                starts, lengths, 1.0, None)


def _offsets(anchor: torch.Tensor, target: torch.Tensor) -> int:
    return (target.data_ptr() - anchor.data_ptr()) // target.element_size()


def test_a_store_read_from_anchors_and_offsets_is_the_store():
    """What a CUDA-graphed step passes (mox.models.kv_store.KVAnchor): fixed anchors laid out
    as one slot, and the offsets to wherever the store is now."""
    q, keys, values, slots, starts, lengths = (a.to(DEVICE) for a in _problem(
        torch.float32, 32, 24, lengths=[3, 50]))
    want = decode_attention_triton(q, keys, values, slots, starts, lengths, 0.2, None)
    anchor_k, anchor_v = torch.empty_like(keys[:1]), torch.empty_like(values[:1])
    offsets = torch.tensor([_offsets(anchor_k, keys), _offsets(anchor_v, values)],
                           device=DEVICE)
    got = decode_attention_triton(q, anchor_k, anchor_v, slots, starts, lengths, 0.2, None,
                                  kv_offsets=offsets)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_output_in_the_query_dtype_is_the_f32_result_rounded():
    q, keys, values, slots, starts, lengths = (a.to(DEVICE) for a in _problem(
        torch.bfloat16, 32, 32, lengths=[4, 19]))
    f32 = decode_attention_triton(q, keys, values, slots, starts, lengths, 0.2, None)
    got = decode_attention_triton(q, keys, values, slots, starts, lengths, 0.2, None,
                                  out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, f32.to(torch.bfloat16))
