"""The architectures added after the first four, batched by the engine (flat prefill chunks,
then per-sequence padded decodes) equal the same prompts run one at a time."""

from __future__ import annotations

import pytest
import torch

from mox import LLM

CASES = ("glm4_moe", "deepseek_v3", "deepseek_v2", "gpt_oss")
NUM_TOKENS = 8


@pytest.mark.parametrize("case", CASES)
def test_batched_generation_equals_one_at_a_time(hf_checkpoints, case):
    path, hf_model = hf_checkpoints[case]
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (3, 13, 8)]
    llm = LLM(path, dtype="float32")
    kwargs = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    batched = [out.token_ids for out in llm.generate(prompt_token_ids=prompts, **kwargs)]
    alone = [llm.generate(prompt_token_ids=[p], **kwargs)[0].token_ids for p in prompts]
    assert batched == alone
