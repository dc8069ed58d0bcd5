"""A field config.json leaves out means what transformers (the oracle) assumes for that
architecture: each field of transformers' own default config is dropped in turn, and mox either
refuses the config (naming the field) or reads the same model as with the field written out."""

from __future__ import annotations

import json
import logging

import pytest

from mox.loaders import CheckpointError, parse_config

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3",
                 "deepseek_v2", "gpt_oss")
# where transformers' default config is not one a model can have (glm4_moe: 42-dim heads with
# half of them rotated; deepseek_v2: no top-k), the least that makes it one
FIXES = {"glm4_moe": {"head_dim": 128}, "deepseek_v2": {"num_experts_per_tok": 6}}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_missing_field_takes_transformers_default(arch):
    from transformers import AutoConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)
    full = {**json.loads(AutoConfig.for_model(arch).to_json_string()), **FIXES.get(arch, {})}
    expected = parse_config(full)
    differ = []
    for key in sorted(set(full) - {"model_type"}):
        try:
            spec = parse_config({k: v for k, v in full.items() if k != key})
        except CheckpointError:
            continue                      # refused, naming what is missing: never silent
        if spec != expected:
            differ.append(key)
    assert differ == [], f"{arch}: without these fields mox reads another model: {differ}"
