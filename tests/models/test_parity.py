"""mox against transformers on the same checkpoints (fp32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from mox import LLM
from mox.loaders import INDEX_FILE, Checkpoint
from tests.conftest import CASES, make_hf_checkpoint, open_tiny

LOGIT_ATOL = 1e-4
NUM_GREEDY_TOKENS = 32
CPU = torch.device("cpu")


def _prompt(seed: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    model = open_tiny(path)
    ids = _prompt(1, 20, hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    actual = model.forward(ids, model.new_cache())
    assert expected.abs().mean() > 0.3, "logits too small for the bound to mean anything"
    torch.testing.assert_close(actual, expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_matches_transformers(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    ids = _prompt(2, 7, hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model.generate(ids[None], attention_mask=torch.ones_like(ids[None]),
                                     max_new_tokens=NUM_GREEDY_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, ids.numel():]
    llm = LLM(path, dtype="float32")
    out = llm.generate(prompt_token_ids=[ids.tolist()], max_tokens=NUM_GREEDY_TOKENS,
                       temperature=0.0, ignore_eos=True)[0]
    assert out.token_ids == expected.tolist()
    assert out.finish_reason == "length"


@pytest.mark.parametrize("case", list(CASES))
def test_kv_cache_decode_equals_full_recomputation(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    model = open_tiny(path)
    ids = _prompt(3, 16, hf_model.config.vocab_size)
    full = model.forward(ids, model.new_cache())
    cache = model.new_cache()
    pieces = [model.forward(ids[:5], cache)]                 # a prefill, then one at a time
    pieces += [model.forward(ids[i:i + 1], cache) for i in range(5, ids.numel())]
    torch.testing.assert_close(torch.cat(pieces), full, atol=LOGIT_ATOL, rtol=0)
    assert cache.num_tokens == ids.numel()
    model.experts.check_integrity()


def test_sharded_checkpoint_with_index(tmp_path):
    path = str(tmp_path / "sharded")
    hf_model = make_hf_checkpoint(path, "qwen2_moe", max_shard_size="40KB", seed=5)
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) >= 2 and os.path.exists(os.path.join(path, INDEX_FILE))
    assert len({info.file for info in Checkpoint(path).tensors.values()}) == len(shards)
    model = open_tiny(path)
    ids = _prompt(4, 12, hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(model.forward(ids, model.new_cache()), expected,
                               atol=LOGIT_ATOL, rtol=0)


def test_bfloat16_forward_tracks_float32(hf_checkpoints):
    path, hf_model = hf_checkpoints["qwen3_moe"]
    ids = _prompt(6, 12, hf_model.config.vocab_size)
    ref_model = open_tiny(path)
    bf16_model = open_tiny(path, torch.bfloat16)
    ref = ref_model.forward(ids, ref_model.new_cache())
    got = bf16_model.forward(ids, bf16_model.new_cache())
    # bf16 keeps ~3 significant digits; the argmax should mostly survive
    assert (got - ref).abs().max() < 0.25
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
