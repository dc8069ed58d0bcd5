"""RoPE frequencies and scales against transformers' own initializers."""

from __future__ import annotations

import pytest
import torch

from mox.loaders import CheckpointError, parse_config
from mox.loaders.rope import rope_scale
from mox.models.rotary import Rotary, inverse_frequencies

BASE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=32,
            num_experts_per_tok=2, max_position_embeddings=4096, intermediate_size=16,
            head_dim=16)
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def _hf_inv_freq(model_type: str, **config):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(model_type, **config)
    kind = hf_config.rope_parameters["rope_type"]
    if kind == "default":
        return None
    return ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")


@pytest.mark.parametrize("model_type,config", [
    ("mixtral", dict(num_local_experts=4, rope_parameters={**YARN, "truncate": False})),
    ("mixtral", dict(num_local_experts=4, rope_parameters=YARN)),
    ("mixtral", dict(num_local_experts=4, rope_parameters={
        **YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707})),
    ("mixtral", dict(num_local_experts=4, rope_parameters={**YARN, "attention_factor": 1.3})),
])
def test_yarn_matches_transformers(model_type, config):
    spec = parse_config({"model_type": model_type, **BASE, **config})
    inv_freq, scale = _hf_inv_freq(model_type, **BASE, **config)
    assert torch.equal(inverse_frequencies(spec.rope), inv_freq)
    assert rope_scale(spec.rope) == pytest.approx(scale, rel=1e-12)


def test_partial_rotary_leaves_the_tail_alone():
    spec = parse_config({"model_type": "glm4_moe", **BASE, "n_routed_experts": 4,
                         "moe_intermediate_size": 8, "head_dim": 16,
                         "first_k_dense_replace": 0, "partial_rotary_factor": 0.25})
    rotary = Rotary(spec.rope, torch.device("cpu"))
    assert spec.rope.rotary_dim == 4 and rotary.inv_freq.numel() == 2
    x = torch.randn(3, 2, 16)
    out = rotary.rotate(x, rotary.tables(torch.tensor([0, 5, 9]), 9))
    assert torch.equal(out[..., 4:], x[..., 4:]) and not torch.equal(out[1:, :, :4], x[1:, :, :4])
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)   # a rotation


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "factor": 2.0}])
def test_unsupported_scaling_is_refused(rope):
    kind = rope["rope_type"]
    with pytest.raises(CheckpointError, match=f"unsupported rope_scaling type '{kind}'"):
        parse_config({"model_type": "mixtral", **BASE, "num_local_experts": 4,
                      "rope_scaling": rope})
