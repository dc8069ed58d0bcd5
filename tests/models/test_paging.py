"""Generation through a tiny expert budget equals generation with every expert resident."""

from __future__ import annotations

import pytest
import torch

from mox import LLM
from tests.conftest import CASES

NUM_TOKENS = 12


def _greedy(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate(prompt_token_ids=[prompt], max_tokens=NUM_TOKENS, temperature=0.0,
                        ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_budgeted_generation_equals_all_resident(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    prompt = torch.randint(0, hf_model.config.vocab_size, (16,),
                           generator=torch.Generator().manual_seed(9)).tolist()
    expected = _greedy(LLM(path, dtype="float32"), prompt)
    top_k = hf_model.config.num_experts_per_tok
    expert_bytes = LLM(path, dtype="float32", expert_memory="1GiB").pager_stats()["expert_bytes"]
    # a pool of top_k + 1 slots for all layers: a 16-token prefill touches far more
    llm = LLM(path, dtype="float32", expert_memory=(top_k + 1) * expert_bytes)
    assert _greedy(llm, prompt) == expected
    stats = llm.pager_stats()
    num_moe_layers = sum(llm.model.spec.moe_layers)
    assert stats["misses"] > 0 and stats["evictions"] > 0
    assert stats["waves"] > num_moe_layers * (NUM_TOKENS + 1)      # some steps needed waves
    assert stats["peak_resident_bytes"] <= stats["budget_bytes"]
    llm.pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "lfu", "rate"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_every_policy_and_prefetch_setting_keeps_outputs(hf_checkpoints, policy, prefetch):
    path, hf_model = hf_checkpoints["olmoe"]
    prompt = list(range(3, 14))
    expected = _greedy(LLM(path, dtype="float32"), prompt)
    llm = LLM(path, dtype="float32", expert_memory="150KiB", policy=policy, prefetch=prefetch)
    assert _greedy(llm, prompt) == expected
    stats = llm.pager_stats()
    assert stats["misses"] > 0
    assert (stats["prefetches"] > 0) == prefetch


def test_host_memory_tier_in_the_llm(hf_checkpoints):
    path, _ = hf_checkpoints["mixtral"]
    prompt = list(range(5, 15))
    expected = _greedy(LLM(path, dtype="float32"), prompt)
    llm = LLM(path, dtype="float32", expert_memory="100KiB", host_memory="4MiB")
    assert _greedy(llm, prompt) == expected
    assert llm.pager_stats()["bytes_read_host"] > 0


def test_bad_pager_arguments_are_refused(hf_checkpoints):
    from mox.errors import InvalidRequestError, MoxError

    path, _ = hf_checkpoints["olmoe"]
    with pytest.raises(InvalidRequestError, match="policy"):
        LLM(path, policy="fifo")
    with pytest.raises(InvalidRequestError, match="size"):
        LLM(path, expert_memory="lots")
    with pytest.raises(MoxError, match="top_k"):
        LLM(path, expert_memory=1000)


def test_a_request_hitting_a_damaged_file_fails_and_the_next_works(hf_checkpoints, tmp_path):
    import shutil

    from mox.errors import ModelUnavailableError

    path = tmp_path / "olmoe"
    shutil.copytree(hf_checkpoints["olmoe"][0], path)
    prompt = list(range(3, 14))
    llm = LLM(str(path), dtype="float32", expert_memory="150KiB", prefetch=False)
    expected = _greedy(llm, prompt)
    shard = path / "model.safetensors"
    saved = shard.read_bytes()
    shard.write_bytes(saved[:len(saved) // 2])        # truncated while serving
    with pytest.raises(ModelUnavailableError, match=r"model\.safetensors.*layer \d expert \d"):
        for _ in range(4):                             # until a step misses a lost expert
            _greedy(llm, prompt)
    llm.pool.check_integrity()
    shard.write_bytes(saved)                           # the file is back
    assert _greedy(llm, prompt) == expected
