"""GPT-OSS's expert math in the fused MoE: expert biases and the clamped SwiGLU, on every
torch path against the reference and against transformers' own expert module."""

from __future__ import annotations

import pytest
import torch

from mox.kernels import Activation, MoEWorkspace, fused_moe, moe_torch, reference_fused_moe
from tests.kernels.problems import make_problem

ALPHA, LIMIT = 1.702, 0.7     # a low limit, so random activations do clamp


def _biases(num_slots: int, hidden: int, inter: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(num_slots, 2 * inter, generator=gen).to(dtype),
            torch.randn(num_slots, hidden, generator=gen).to(dtype))


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,k,num_slots", [
    (1, 16, 8, 4, 2, 4), (7, 32, 16, 8, 2, 12), (33, 64, 32, 16, 4, 20)])
@pytest.mark.parametrize("grouped_mm_max_rows", [0, 10**9], ids=["looped", "grouped_mm"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_biases_and_clamped_swiglu_match_reference(num_tokens, hidden, inter, num_experts, k,
                                                   num_slots, grouped_mm_max_rows, dtype,
                                                   atol, monkeypatch):
    monkeypatch.setattr(moe_torch, "GROUPED_MM_MAX_ROWS_PER_EXPERT", grouped_mm_max_rows)
    monkeypatch.setattr(moe_torch, "GROUPED_MM_MIN_ACTIVE_FRACTION", 0.0)
    args = make_problem(num_tokens, hidden, inter, num_experts, k, num_slots, dtype,
                        num_missing=num_experts // 4)
    b13, b2 = _biases(num_slots, hidden, inter, dtype)
    act = Activation("clamped_swiglu", ALPHA, LIMIT)
    expected = reference_fused_moe(*args, act, b13, b2)
    actual = fused_moe(*args, "clamped_swiglu", backend="torch", workspace=MoEWorkspace(),
                       b13=b13, b2=b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_matches_transformers_gpt_oss_experts():
    """The slot layout (gate rows, then up rows) of GPT-OSS's interleaved, transposed
    `[E, H, 2I]` weights computes what its own expert module computes."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    num_experts, hidden, inter, k, num_tokens = 4, 32, 16, 2, 9
    config = AutoConfig.for_model("gpt_oss", hidden_size=hidden, intermediate_size=inter,
                                  num_local_experts=num_experts, swiglu_limit=LIMIT)
    module = GptOssExperts(config)
    # older transformers (5.17 seen) hard-code alpha 1.702 and limit 7.0
    module.alpha, module.limit = ALPHA, LIMIT
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, k, generator=gen), -1)
    with torch.no_grad():
        expected = module(x, ids, weights)
    gate_up = module.gate_up_proj.detach()                                 # [E, H, 2I]
    w13 = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), -1).transpose(1, 2)  # [E, 2I, H]
    b = module.gate_up_proj_bias.detach()
    b13 = torch.cat((b[:, 0::2], b[:, 1::2]), -1)
    w2 = module.down_proj.detach().transpose(1, 2).contiguous()           # [E, H, I]
    slots = torch.arange(num_experts, dtype=torch.int32)
    actual = fused_moe(x, w13.contiguous(), w2, weights, ids.to(torch.int32), slots,
                       "clamped_swiglu", backend="torch", b13=b13,
                       b2=module.down_proj_bias.detach(), swiglu_alpha=ALPHA,
                       swiglu_limit=LIMIT)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_triton_path_refuses_what_it_does_not_run():
    args = make_problem(4, 16, 8, 4, 2, 4, torch.float32)
    b13, b2 = _biases(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="Triton MoE path runs activation 'silu'"):
        fused_moe(*args, "clamped_swiglu", backend="triton")
    with pytest.raises(ValueError, match="with biases"):
        fused_moe(*args, backend="triton", b13=b13, b2=b2)
    with pytest.raises(ValueError, match="unsupported activation 'gelu'"):
        fused_moe(*args, "gelu")
