"""A prompt longer than a step's token budget prefills in chunks; on the CPU's native bf16
path too, where a chunk that samples nothing must compute no logits (the final norm refused
an empty batch, so every prompt over 256 tokens failed)."""

from __future__ import annotations

import pytest
import torch

from mox.engine import Engine, SchedulerConfig
from mox.messages import FinishReason, Request
from mox.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, open_tiny, serve_loaded

PROMPT = [(7 * i + 3) % 90 + 5 for i in range(41)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chunked") / "mixtral")
    make_hf_checkpoint(path, "mixtral")
    return open_tiny(path, torch.bfloat16)


def _generate(model, max_batched_tokens: int) -> tuple[list[int], FinishReason, int]:
    """The greedy tokens, the finish reason and the engine steps it took."""
    engine = Engine(16 << 20, block_size=4,
                    config=SchedulerConfig(max_batched_tokens=max_batched_tokens))
    serve_loaded(engine, "m", model)
    engine.add_request(Request("r", "m", PROMPT, GREEDY))
    tokens, reason, steps = [], None, 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
        engine.kv_pool.check_integrity()
    assert engine.kv_pool.used_bytes == 0
    return tokens, reason, steps


def test_a_long_prompt_prefills_in_chunks_in_bf16(model):
    whole, whole_reason, whole_steps = _generate(model, max_batched_tokens=256)
    chunked, reason, steps = _generate(model, max_batched_tokens=16)
    assert len(chunked) == len(whole) == GREEDY.max_tokens
    assert reason == whole_reason == FinishReason.LENGTH
    assert steps > whole_steps                    # the prompt took three steps, not one
    assert chunked == whole
