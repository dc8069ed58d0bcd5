"""Config variants published configs rarely use, where mox once disagreed with transformers
(a helper's sweep): fields an architecture's reference ignores, and fields config.json leaves
out, which transformers fills with per-architecture defaults. Prefill logits, fp32."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import make_hf_checkpoint, open_tiny
from tests.models.test_parity import LOGIT_ATOL, _prompt

# name -> (case in tests.conftest.CASES, config overrides, fields dropped from config.json
# after transformers saved it, and fields written there then)
VARIANTS = {
    # sliding and full layers alternate when layer_types is absent
    "gpt_oss-no-layer-types": ("gpt_oss", {}, ("layer_types",)),
    # transformers' Qwen2-MoE slides the even layers below max_window_layers
    "qwen2_moe-sliding": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=6,
                                            max_window_layers=2), ("layer_types",)),
    # ... and Qwen3-MoE every layer, whatever max_window_layers says
    "qwen3_moe-sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6,
                                            max_window_layers=1), ()),
    # architectures without sliding attention ignore a sliding_window field
    "olmoe-sliding-field": ("olmoe", dict(sliding_window=6), ()),
    # only OLMoE clamps q, k and v
    "mixtral-clip-qkv-field": ("mixtral", dict(clip_qkv=0.5), ()),
    # missing eps and theta: Mixtral's defaults (1e-5, 1e6), not the common 1e-6 and 10000
    "mixtral-defaults": ("mixtral", dict(rms_norm_eps=1e-5),
                         ("rms_norm_eps", "rope_theta", "rope_parameters")),
    "gpt_oss-defaults": ("gpt_oss", dict(rms_norm_eps=1e-5, rope_parameters=None),
                         ("rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling")),
    # GPT-OSS's YaRN also under a null rope_scaling; an empty rope_parameters is plain RoPE
    "gpt_oss-rope-scaling-null": ("gpt_oss", dict(rope_parameters=None),
                                  ("rope_parameters",), {"rope_scaling": None}),
    "gpt_oss-rope-parameters-empty": ("gpt_oss", dict(rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 150000.0}),
                                      ("rope_parameters",), {"rope_parameters": {}}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(tmp_path, variant):
    case, overrides, dropped, *written = VARIANTS[variant]
    path = str(tmp_path / variant)
    hf_model = make_hf_checkpoint(path, case, **overrides)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    assert any(key in config for key in dropped) or not dropped, "nothing to drop"
    with open(config_file, "w") as f:
        json.dump({k: v for k, v in config.items() if k not in dropped} | {
            k: v for fields in written for k, v in fields.items()}, f)
    model = open_tiny(path)
    ids = _prompt(1, 20, hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    actual = model.forward(ids, model.new_cache())
    torch.testing.assert_close(actual, expected, atol=LOGIT_ATOL, rtol=0)
