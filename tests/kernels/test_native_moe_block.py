"""A decode MoE layer's routing and experts in one native call (kernels/csrc/moe_block.c)
against the Python block's steps (the router GEMV, the routing, fused_moe over the slot map):
the same experts, the same bits; a routed expert that is not resident makes it compute
nothing and hand back the routing; bad arguments are refused before the C code runs."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import fused_moe, native, softmax_topk, topk_softmax
from mox.kernels.activation import CLAMPED_SWIGLU, SILU, Activation
from mox.kernels.native_moe import moe_layer

NATIVE = native.kernels()
pytestmark = pytest.mark.skipif(NATIVE is None or not NATIVE.fast,
                                reason="no native vector kernels on this machine")
E, K, H, INTER, SLOTS = 16, 4, 64, 96, 24   # experts, top-k, hidden, intermediate


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).bfloat16()


def _pools(biases: bool = False):
    w13 = _bf16(SLOTS, 2 * INTER, H, seed=1, scale=0.1)
    w2 = _bf16(SLOTS, H, INTER, seed=2, scale=0.1)
    b13, b2 = (_bf16(SLOTS, 2 * INTER, seed=3, scale=0.1),
               _bf16(SLOTS, H, seed=4, scale=0.1)) if biases else (None, None)
    # every expert in a slot, the map scattered over the pool
    slot_of = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(5))[:E]
    return w13, w2, b13, b2, slot_of.to(torch.int32)


def _python_block(h, router, bias, scoring, renormalize, scaling, pools, activation):
    """What mox/models/moe.py computes step by step (with torch's routing): the weights, ids
    and the experts' sum rounded to bf16."""
    w13, w2, b13, b2, slot_of = pools
    logits = native.gemv_bf16(h, router)
    if bias is not None:
        logits = logits + bias
    if scoring == "topk_softmax":
        weights, ids = topk_softmax(logits, K)
    else:
        weights, ids = softmax_topk(logits, K, renormalize)
        weights = weights * scaling if scaling != 1.0 else weights
    out = fused_moe(h, w13, w2, weights, ids, slot_of, activation.kind, out_dtype=torch.float32,
                    b13=b13, b2=b2, swiglu_alpha=activation.alpha,
                    swiglu_limit=activation.limit)
    return weights, ids, out.to(h.dtype)


# Mixtral / Qwen3 (renormalized), OLMoE (not), a scaled softmax, GPT-OSS (top-k then softmax,
# router bias, expert biases, clamped SwiGLU)
@pytest.mark.parametrize("scoring, renormalize, scaling, gpt_oss", [
    ("softmax_topk", True, 1.0, False), ("softmax_topk", False, 1.0, False),
    ("softmax_topk", True, 2.5, False), ("topk_softmax", False, 1.0, True)])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 19])
def test_moe_block_equals_the_python_blocks_steps(scoring, renormalize, scaling, gpt_oss,
                                                  num_tokens):
    router, bias = _bf16(E, H, seed=6), _bf16(E, seed=7) if gpt_oss else None
    pools = _pools(biases=gpt_oss)
    activation = Activation(CLAMPED_SWIGLU, 1.702, 1.0) if gpt_oss else Activation(SILU)
    h, residual = _bf16(num_tokens, H, seed=8), _bf16(num_tokens, H, seed=9)
    layer = moe_layer(router, bias, INTER, K, scoring, renormalize, scaling)
    weights, ids, x_out = NATIVE.moe_block(layer, h, pools[4], pools[0], pools[1], None,
                                           activation, pools[2], pools[3], residual=residual)
    want_weights, want_ids, experts = _python_block(h, router, bias, scoring, renormalize,
                                                    scaling, pools, activation)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(x_out, residual + experts)
    alone = NATIVE.moe_block(layer, h, pools[4], pools[0], pools[1], None, activation,
                             pools[2], pools[3])[2]              # no residual: the experts
    assert torch.equal(alone, experts)


def test_routing_equals_torchs_with_ties_to_the_lower_expert():
    """bf16 logits tie often: both definitions keep the lower expert id, and the weights
    agree to float32 rounding."""
    gen = torch.Generator().manual_seed(10)
    logits = torch.randint(-3, 4, (64, 32), generator=gen).bfloat16()    # ties everywhere
    for k in (1, 2, 8):
        weights, ids = NATIVE.route(logits, k, "softmax_topk", True, 1.0)
        want_weights, want_ids = softmax_topk(logits, k, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
        weights, ids = NATIVE.route(logits, k, "topk_softmax", False, 1.0)
        want_weights, want_ids = topk_softmax(logits, k)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    first = ids[0].tolist()                                  # the lower id first among equals
    values = logits[0, first].tolist()
    assert all(a > b or (a == b and i < j) for a, b, i, j in
               zip(values, values[1:], first, first[1:]))


def test_a_missing_expert_computes_nothing_and_hands_back_the_routing():
    router, pools = _bf16(E, H, seed=11), _pools()
    w13, w2, _, _, slot_of = pools
    h = _bf16(2, H, seed=12)
    layer = moe_layer(router, None, INTER, K, "softmax_topk", True, 1.0)
    weights, ids, out = NATIVE.moe_block(layer, h, slot_of, w13, w2)
    assert out is not None
    for gone in (-1, SLOTS):     # not resident; a slot past these pools (a defence: a hold
                                 # keeps the pools from growing)
        partial = slot_of.clone()
        partial[ids[1, 2]] = gone
        got_weights, got_ids, out = NATIVE.moe_block(layer, h, partial, w13, w2)
        assert out is None and torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


def test_moe_block_refuses_what_it_cannot_take():
    router, (w13, w2, _, _, slot_of) = _bf16(E, H, seed=13), _pools()
    layer = moe_layer(router, None, INTER, K, "softmax_topk", True, 1.0)
    h = _bf16(2, H, seed=14)
    with pytest.raises(ValueError, match="rows"):
        NATIVE.moe_block(layer, h[:, :32].contiguous(), slot_of, w13, w2)
    with pytest.raises(ValueError, match="slot map"):
        NATIVE.moe_block(layer, h, slot_of.long(), w13, w2)
    with pytest.raises(ValueError, match="residual"):
        NATIVE.moe_block(layer, h, slot_of, w13, w2, residual=h[:1])
    with pytest.raises(ValueError, match="not of hidden size 64"):
        NATIVE.moe_block(layer, h, slot_of, w13[:, :, :32].contiguous(), w2)
    with pytest.raises(ValueError, match="router"):
        moe_layer(router.float(), None, INTER, K, "softmax_topk", True, 1.0)
    with pytest.raises(ValueError, match="top 17"):
        moe_layer(router, None, INTER, E + 1, "softmax_topk", True, 1.0)
