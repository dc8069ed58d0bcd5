"""Router math: gate logits -> (top-k weights, top-k expert ids).

Shapes: T tokens, E experts, k experts per token, G expert groups.
Every function returns weights `[T, k]` float32 and ids `[T, k]` int32 (logical expert ids);
the order of the k columns is not specified (transformers uses unsorted top-k too).
"""

from __future__ import annotations

import torch

# transformers' DeepSeek-V3 / GLM4-MoE add this to the renormalisation denominator; it only
# guards a zero sum, but keeping it makes the weights bit-identical to the oracle.
SIGMOID_RENORM_EPS = 1e-20
# A group's score is the sum of its best this-many (bias-corrected) expert scores.
EXPERTS_PER_GROUP_SCORE = 2


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row, largest first, and their ids. Ties go to the lower
    expert id: bf16 router logits tie often (8 bits of mantissa), and torch.topk breaks ties
    by its selection algorithm, which the native decode block (csrc/moe_block.c) could not
    reproduce; one rule keeps both paths choosing the same experts."""
    values, ids = scores.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def softmax_topk(logits: torch.Tensor, k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE / OLMoE routing: softmax over all E, keep the k largest, optionally
    rescale them to sum to 1. Returns weights `[T, k]` float32 and ids `[T, k]` int32."""
    assert logits.dim() == 2 and 0 < k <= logits.shape[1], (logits.shape, k)
    probs = torch.softmax(logits.float(), dim=-1)           # [T, E]
    weights, ids = top_k(probs, k)                          # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def sigmoid_grouped_topk(logits: torch.Tensor, k: int, correction_bias: torch.Tensor | None,
                         n_group: int, topk_group: int, renormalize: bool,
                         routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM4-MoE routing. The correction bias steers only the *choice* of
    experts (groups, then experts within the kept groups); the weights are the unbiased
    sigmoid scores, optionally renormalised, and always times `routed_scaling_factor`."""
    assert logits.dim() == 2, logits.shape
    num_tokens, num_experts = logits.shape
    group_size = num_experts // n_group
    assert num_experts % n_group == 0, (num_experts, n_group)
    assert group_size >= EXPERTS_PER_GROUP_SCORE, (num_experts, n_group)
    assert 0 < topk_group <= n_group and 0 < k <= topk_group * group_size, (k, topk_group)
    assert correction_bias is None or correction_bias.shape == (num_experts,)
    scores = torch.sigmoid(logits.float())                                   # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    group_scores = (choice.reshape(num_tokens, n_group, group_size)             # [T, G, E/G]
                    .topk(EXPERTS_PER_GROUP_SCORE, dim=-1).values.sum(dim=-1))  # [T, G]
    kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)            # [T, G]
    group_mask.scatter_(1, kept_groups, True)
    expert_mask = group_mask.repeat_interleave(group_size, dim=1)            # [T, E]
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(k, dim=-1, sorted=False).indices                       # [T, k]
    weights = scores.gather(1, ids)                                          # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_RENORM_EPS)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def softmax_group_limited_topk(logits: torch.Tensor, k: int, n_group: int,
                               topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 `group_limited_greedy`: softmax over all E; each group scores its best
    expert; the k largest probabilities among the `topk_group` best groups. Weights are the
    probabilities themselves (no renormalisation)."""
    assert logits.dim() == 2, logits.shape
    num_tokens, num_experts = logits.shape
    assert num_experts % n_group == 0 and 0 < topk_group <= n_group, (num_experts, n_group)
    group_size = num_experts // n_group
    assert 0 < k <= topk_group * group_size, (k, topk_group, group_size)
    probs = torch.softmax(logits.float(), dim=-1)                             # [T, E]
    group_scores = probs.reshape(num_tokens, n_group, group_size).amax(dim=-1)  # [T, G]
    kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, kept_groups, True)
    probs = probs.masked_fill(~group_mask.repeat_interleave(group_size, dim=1), 0.0)
    weights, ids = probs.topk(k, dim=-1, sorted=False)                        # [T, k]
    return weights, ids.to(torch.int32)


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: the k largest logits (router bias already added), then a softmax
    over just those k, so the weights always sum to 1."""
    assert logits.dim() == 2 and 0 < k <= logits.shape[1], (logits.shape, k)
    top_logits, ids = top_k(logits.float(), k)                               # [T, k]
    weights = torch.softmax(top_logits, dim=-1)                              # [T, k]
    return weights, ids.to(torch.int32)
