"""Multi-step decode (`SchedulerConfig.decode_steps`): a decode batch's steps run back to back
under one hold give the tokens, log-probabilities and hits of one step per engine step; they
page where an expert is missing and go on, and stop at a stop token with nothing lost."""

from __future__ import annotations

import pytest
import torch

from mox.engine import Engine, SchedulerConfig
from mox.kernels import native
from mox.messages import FinishReason, Request
from mox.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint, open_tiny, serve_loaded

pytestmark = pytest.mark.skipif(native.kernels() is None or not native.kernels().fast,
                                reason="no native vector kernels on this machine")
# cases whose decode steps chain every layer natively (tests/models/test_decode_layers.py)
OVERRIDES = {"mixtral": {}, "olmoe": dict(clip_qkv=None)}
GREEDY = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=11, temperature=0.9, seed=5, logprobs=True,
                         ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_step")
    built = {}
    for case, overrides in OVERRIDES.items():
        make_hf_checkpoint(str(root / case), case, **overrides)
        built[case] = open_tiny(str(root / case), torch.bfloat16)
    return built


def _generate(model, decode_steps: int, requests: list[tuple[list[int], SamplingParams]],
              interrupt=None):
    """Each request's tokens, log-probabilities and finish reason, the engine steps it took
    and the pager's hits, on a fresh engine (`interrupt`: the engine's, if given)."""
    # (no time limit on a run: its length would follow this machine's step time)
    engine = Engine(16 << 20, block_size=4, interrupt=interrupt,
                    config=SchedulerConfig(decode_steps=decode_steps, decode_run_s=None))
    serve_loaded(engine, "m", model)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(Request(f"r{i}", "m", prompt, params))
    hits, results, steps = model.experts.stats()["hits"], {}, 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            tokens, logprobs, _ = results.setdefault(out.request_id, ([], [], None))
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
            results[out.request_id] = tokens, logprobs, out.finish_reason
        engine.kv_pool.check_integrity()
    assert engine.kv_pool.used_bytes == 0                                  # every block back
    assert model.experts.slot_pool.holds == 0
    return results, steps, model.experts.stats()["hits"] - hits


@pytest.mark.parametrize("case", OVERRIDES)
def test_steps_back_to_back_give_the_tokens_of_one_step_at_a_time(models, case):
    requests = [([5, 9, 2, 7, 1], GREEDY), ([3] * 9, GREEDY), ([8, 4, 6], SAMPLED)]
    one, one_steps, one_hits = _generate(models[case], 1, requests)
    four, four_steps, four_hits = _generate(models[case], 4, requests)
    assert four == one
    assert all(len(tokens) == 11 for tokens, _, _ in one.values())
    assert four_steps < one_steps              # the steps did run back to back
    assert four_hits == one_hits               # every step's experts counted


def test_a_step_that_misses_pages_and_the_run_goes_on(models):
    model, requests = models["mixtral"], [([5, 9, 2, 7, 1], GREEDY), ([3] * 9, GREEDY)]
    want, _, _ = _generate(model, 1, requests)
    pool = model.experts
    pool.resize(pool.top_k)                    # two slots of eight: most layers miss
    try:
        misses = pool.stats()["misses"]
        got, _, _ = _generate(model, 4, requests)
        assert pool.stats()["misses"] > misses
        pool.check_integrity()
    finally:
        pool.resize(pool.max_slots)
    assert got == want


def test_a_stop_token_ends_the_run_where_one_step_at_a_time_would(models):
    model, prompt = models["olmoe"], [5, 9, 2, 7, 1]
    free_run, _, _ = _generate(model, 1, [(prompt, GREEDY)])
    tokens = free_run["r0"][0]
    # a token of the middle that does not come earlier: the run must stop right after it
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(max_tokens=11, temperature=0.0, stop_token_ids=(tokens[at],))
    _, _, one_hits = _generate(model, 1, [(prompt, params)])
    got, _, hits = _generate(model, 8, [(prompt, params)])
    assert got["r0"] == (tokens[:at + 1], [], FinishReason.STOP)
    assert hits == one_hits                    # no step ran past it


def test_an_interrupt_ends_the_run_after_the_step_in_progress(models):
    model, requests = models["olmoe"], [([5, 9, 2, 7, 1], GREEDY), ([3] * 9, GREEDY)]
    one, one_steps, one_hits = _generate(model, 1, requests)
    asked = []

    def interrupt() -> bool:             # something waits after every third step of a run
        asked.append(True)
        return len(asked) % 3 == 0

    got, steps, hits = _generate(model, 8, requests, interrupt)
    assert got == one and hits == one_hits
    # the prompts' step, then runs of 3, 3, 3 and 1 steps (the ten tokens max_tokens leaves)
    assert steps == 1 + 4 and one_steps == 11
