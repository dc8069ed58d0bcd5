"""config.json values of the wrong type or out of range are a CheckpointError naming the file,
never a traceback from deep in a parser or a 500 at the first request."""

from __future__ import annotations

import pytest

from mox.loaders import CheckpointError, parse_config

BASE = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
            vocab_size=32, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def test_the_base_config_parses():
    spec = parse_config(BASE)
    assert (spec.num_layers, spec.num_experts, spec.top_k) == (2, 4, 2)


@pytest.mark.parametrize("field, value, match", [
    ("num_experts_per_tok", 0, "num_experts_per_tok must be between 1"),
    ("num_experts_per_tok", 5, "num_experts_per_tok must be between 1"),
    ("num_experts_per_tok", None, "num_experts_per_tok must be an integer"),
    ("num_experts_per_tok", "2", "num_experts_per_tok must be an integer"),
    ("num_hidden_layers", -1, "num_hidden_layers must be at least 1"),
    ("num_attention_heads", 0, "malformed"),
    ("eos_token_id", "</s>", "eos_token_id must be token ids"),
    ("model_type", ["mixtral"], "unsupported model_type"),
    ("rope_theta", "big", "malformed"),
])
def test_a_bad_value_names_the_file(field, value, match):
    with pytest.raises(CheckpointError, match=match) as e:
        parse_config({**BASE, field: value}, "/ckpt/config.json")
    assert e.value.path == "/ckpt/config.json"


# DeepSeek-V3 with 8 routed experts: its grouped routing's fields
DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4,
                num_hidden_layers=2, vocab_size=32, intermediate_size=64,
                moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, n_group=2, topk_group=1, first_k_dense_replace=1,
                num_key_value_heads=4)


@pytest.mark.parametrize("fields, match", [
    (dict(n_group=3), "n_group 3 does not divide the 8 routed experts"),
    (dict(topk_group=3), "topk_group must be between 1 and n_group 2, not 3"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5 is more than the 4 experts"),
    (dict(n_group=8, topk_group=4), "groups of 1 expert"),
])
def test_grouped_routing_that_cannot_route_is_refused_at_load(fields, match):
    assert parse_config(DEEPSEEK).router.n_group == 2
    with pytest.raises(CheckpointError, match=match):
        parse_config({**DEEPSEEK, **fields}, "/ckpt/config.json")


def test_a_config_without_moe_layers_is_refused():
    qwen = dict(model_type="qwen2_moe", hidden_size=64, num_attention_heads=4, vocab_size=32,
                num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=16,
                num_experts=4, num_experts_per_tok=2)
    assert sum(parse_config({**qwen, "decoder_sparse_step": 3}).moe_layers) == 1
    with pytest.raises(CheckpointError, match="no layer is a mixture of experts"):
        parse_config({**qwen, "decoder_sparse_step": 3, "mlp_only_layers": [2]})
