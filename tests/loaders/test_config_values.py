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
    ("num_experts_per_tok", None, "malformed"),
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
