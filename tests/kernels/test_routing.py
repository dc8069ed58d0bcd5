"""Router math against transformers' own router modules, on random weights and inputs."""

from __future__ import annotations

import pytest
import torch

from mox.kernels.routing import (
    sigmoid_grouped_topk,
    softmax_group_limited_topk,
    softmax_topk,
    topk_softmax,
)

NUM_TOKENS = 64
HIDDEN = 32
ATOL = 1e-6


def _by_expert(weights, ids):
    """Sort each token's k columns by expert id, so unsorted top-k outputs compare."""
    ids, order = ids.long().sort(dim=-1)                     # [T, k]
    return weights.gather(1, order), ids


def _assert_same_routing(ours, theirs):
    (w, ids), (w_ref, ids_ref) = _by_expert(*ours), _by_expert(*theirs)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref.float(), atol=ATOL, rtol=0)


def _randomize(router, gen, bias_name=None, bias_scale=0.0):
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if bias_name is not None:
            bias = getattr(router, bias_name)
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=gen))
    return router.eval()


def _grouped_router(model_type, num_experts, n_group, topk_group, k, renormalize, scale):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, n_routed_experts=num_experts, num_experts_per_tok=k,
        n_group=n_group, topk_group=topk_group, norm_topk_prob=renormalize,
        routed_scaling_factor=scale)
    cls = {"deepseek_v3": DeepseekV3TopkRouter, "glm4_moe": Glm4MoeTopkRouter}[model_type]
    return cls(config)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("num_experts,n_group,topk_group,k", [
    (8, 1, 1, 2), (16, 4, 2, 4), (32, 8, 4, 8), (64, 8, 3, 6), (16, 8, 8, 3), (12, 3, 1, 4),
])
@pytest.mark.parametrize("renormalize,scale", [(True, 2.5), (False, 1.0), (False, 2.5)])
@pytest.mark.parametrize("bias_scale", [0.0, 0.5])
def test_sigmoid_grouped_topk_matches_transformers(model_type, num_experts, n_group,
                                                   topk_group, k, renormalize, scale,
                                                   bias_scale):
    gen = torch.Generator().manual_seed(num_experts * 100 + n_group * 10 + k)
    router = _grouped_router(model_type, num_experts, n_group, topk_group, k, renormalize,
                             scale)
    _randomize(router, gen, "e_score_correction_bias", bias_scale)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen) / HIDDEN**0.5
    with torch.no_grad():
        logits, w_ref, ids_ref = router(hidden)
    bias = router.e_score_correction_bias if bias_scale else None
    ours = sigmoid_grouped_topk(logits, k, bias, n_group, topk_group, renormalize, scale)
    _assert_same_routing(ours, (w_ref, ids_ref))


def test_correction_bias_steers_choice_not_weights():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(NUM_TOKENS, 16, generator=gen)
    bias = torch.zeros(16)
    bias[3] = 10.0                                           # expert 3 always chosen
    weights, ids = sigmoid_grouped_topk(logits, 2, bias, 4, 2, False, 1.0)
    assert (ids == 3).any(dim=-1).all()
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids.long()))


@pytest.mark.parametrize("num_experts,n_group,topk_group,k", [
    (16, 4, 2, 4), (32, 8, 3, 6), (12, 3, 1, 4), (8, 1, 1, 2)])
def test_softmax_group_limited_topk_matches_deepseek_v2(num_experts, n_group, topk_group, k):
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = AutoConfig.for_model(
        "deepseek_v2", hidden_size=HIDDEN, n_routed_experts=num_experts, num_experts_per_tok=k,
        n_group=n_group, topk_group=topk_group, topk_method="group_limited_greedy",
        routed_scaling_factor=1.0)
    gen = torch.Generator().manual_seed(num_experts + k)
    router = _randomize(DeepseekV2TopkRouter(config), gen)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen) / HIDDEN**0.5
    with torch.no_grad():
        logits, w_ref, ids_ref = router(hidden)
    ours = softmax_group_limited_topk(logits, k, n_group, topk_group)
    _assert_same_routing(ours, (w_ref, ids_ref))


@pytest.mark.parametrize("num_experts,k", [(4, 1), (8, 2), (32, 4), (16, 16)])
def test_topk_softmax_matches_gpt_oss(num_experts, k):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = AutoConfig.for_model("gpt_oss", hidden_size=HIDDEN, num_local_experts=num_experts,
                                  num_experts_per_tok=k)
    gen = torch.Generator().manual_seed(num_experts + k)
    router = _randomize(GptOssTopKRouter(config), gen, "bias", 1.0)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen) / HIDDEN**0.5
    with torch.no_grad():
        logits, w_ref, ids_ref = router(hidden)
    _assert_same_routing(topk_softmax(logits, k), (w_ref, ids_ref))


ALL_ROUTERS = [
    lambda logits: softmax_topk(logits, 3, renormalize=True),
    lambda logits: sigmoid_grouped_topk(logits, 3, torch.zeros(16), 4, 2, True, 2.5),
    lambda logits: topk_softmax(logits, 3),
]


@pytest.mark.parametrize("route", ALL_ROUTERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_dtypes_and_shapes(route, dtype):
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, ids = route(logits)
    assert weights.dtype == torch.float32 and weights.shape == (5, 3)
    assert ids.dtype == torch.int32 and ids.shape == (5, 3)
    assert ((ids >= 0) & (ids < 16)).all()


def test_bad_shapes_are_refused():
    logits = torch.randn(4, 16)
    with pytest.raises(AssertionError):
        topk_softmax(logits[0], 2)                           # not [T, E]
    with pytest.raises(AssertionError):
        sigmoid_grouped_topk(logits, 2, None, 3, 1, True, 1.0)   # E not divisible by G
    with pytest.raises(AssertionError):
        sigmoid_grouped_topk(logits, 9, None, 4, 2, True, 1.0)   # k > kept experts
    with pytest.raises(AssertionError):
        sigmoid_grouped_topk(logits, 2, torch.zeros(8), 4, 2, True, 1.0)  # bias not [E]
