"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch

from mox import LLM


@pytest.fixture()
def mapped_mixtral(hf_checkpoints):
    """Tiny Mixtral in fp32, every expert through the host cache once, then a quarter of
    them in slots: a step reads the rest in place from the host cache (the GPU's table path,
    with plain CPU tensors standing in for pinned host memory)."""
    llm = LLM(hf_checkpoints["mixtral"][0], dtype=torch.float32, kv_memory=1 << 20,
              host_memory="64MiB")
    pool = llm.model.experts
    for moe_layer in range(pool.num_moe_layers):
        for _ in pool.waves(moe_layer, range(pool.num_experts)):
            pass
    pool.resize(max(pool.top_k, pool.max_slots // 4))
    pool.wait_for_loads()
    yield llm.model
