"""Multi-head latent attention: the KV store holds the compressed latent and the rotated rope
key, the same numbers transformers caches, and nothing per head."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import open_tiny


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2"])
def test_kv_store_caches_the_latent_not_keys_and_values(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    model = open_tiny(path)
    mla = model.spec.mla
    ids = torch.randint(0, hf_model.config.vocab_size, (11,),
                        generator=torch.Generator().manual_seed(7))
    cache = model.new_cache()
    model.forward(ids, cache)
    store = cache.store
    per_token = mla.kv_lora_rank + mla.qk_rope_head_dim
    assert store.block_nbytes == model.spec.num_layers * store.block_size * per_token * 4
    hf_cache = DynamicCache(config=hf_model.config)
    with torch.no_grad():
        hf_model(ids[None], cache=hf_cache, use_cache=True)
    slots = torch.arange(ids.numel())
    for layer in range(model.spec.num_layers):
        latents, rope_keys = store.gather(layer, slots)          # [T, 1, r], [T, 1, d_r]
        assert latents.shape == (ids.numel(), 1, mla.kv_lora_rank)
        assert rope_keys.shape == (ids.numel(), 1, mla.qk_rope_head_dim)
        hf_latents = hf_cache.layers[layer].keys[0].transpose(0, 1)      # [T, 1, r]
        hf_rope_keys = hf_cache.layers[layer].values[0].transpose(0, 1)
        if case == "deepseek_v2":     # complex pairs stay interleaved there; we list evens, odds
            hf_rope_keys = torch.cat((hf_rope_keys[..., 0::2], hf_rope_keys[..., 1::2]), -1)
        torch.testing.assert_close(latents, hf_latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(rope_keys, hf_rope_keys, atol=1e-5, rtol=0)
