from __future__ import annotations

import pytest
import torch

from mox.engine.runner import ModelRunner
from mox.engine.sequence import Sequence
from mox.errors import InvalidRequestError
from mox.messages import Request
from mox.sampling import SamplingParams, greedy_tokens, nucleus, sample


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    gen = params.new_generator(torch.device("cpu"))
    return [sample(logits, params, gen) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(50)
    assert sample(logits, SamplingParams(temperature=0.0), torch.Generator()) == logits.argmax()


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(50)
    a = _draws(SamplingParams(seed=7), logits, 20)
    assert a == _draws(SamplingParams(seed=7), logits, 20)
    assert a != _draws(SamplingParams(seed=8), logits, 20)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(50)
    assert set(_draws(SamplingParams(top_k=1, seed=0), logits, 10)) == {int(logits.argmax())}
    assert set(_draws(SamplingParams(top_p=1e-6, seed=0), logits, 10)) == {int(logits.argmax())}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-39, seed=0), SamplingParams(temperature=5e-324, seed=0),
    SamplingParams(top_p=5e-324, seed=0), SamplingParams(top_p=5.7e-288, seed=0)])
def test_parameters_that_underflow_float32_sample_the_argmax(params):
    """Found by the API fuzz: these made inf/NaN probabilities and a failed step."""
    logits = torch.randn(50) * 10
    assert set(_draws(params, logits, 5)) == {int(logits.argmax())}


def test_top_k_keeps_only_the_k_best():
    logits = torch.randn(50)
    best = set(torch.topk(logits, 3).indices.tolist())
    assert set(_draws(SamplingParams(top_k=3, temperature=5.0, seed=1), logits, 200)) <= best


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0])   # the first two hold ~0.88
    drawn = set(_draws(SamplingParams(top_p=0.8, seed=2), logits, 200))
    assert drawn == {0, 1}


@pytest.mark.parametrize("top_p", [0.9, 0.9999])
def test_the_nucleus_is_exact_over_a_large_vocabulary(top_p):
    """The smallest set of most likely tokens whose mass reaches top_p, as float64 counts it
    (float32's probabilities summed to 1.000005 over 152k tokens: p = 0.9999 kept 115369 of
    the 115955 it needs, p = 0.9 one token short)."""
    logits = 3 * torch.randn(151936, generator=torch.Generator().manual_seed(0))
    exact = torch.softmax(logits.double(), dim=-1).sort(descending=True).values
    needed = int(torch.searchsorted(exact.cumsum(0), top_p)) + 1
    kept = nucleus(torch.softmax(logits, dim=-1), top_p)
    assert int((kept > 0).sum()) == needed


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0),
                                    dict(top_k=-5), dict(stop=("",)),
                                    # types (the offline API passes what it is given)
                                    dict(max_tokens=True), dict(max_tokens="16"),
                                    dict(temperature=float("nan")), dict(top_p=float("inf")),
                                    dict(temperature="1"), dict(top_k=2.0), dict(seed=2**64),
                                    dict(seed="7"), dict(stop=(1,)), dict(stop={"a"}),
                                    dict(stop_token_ids=(1.0,))])
def test_invalid_parameters_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_one_stop_string_and_lists_are_taken_as_tuples():
    params = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert params.stop == ("###",) and params.stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_rows_take_the_first_of_equal_maxima_and_nans_as_torch():
    """(numpy's argmax on a CPU: the same choices as torch's, ties and NaNs included)"""
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [float("nan"), 3.0, float("nan"), 0.0],
                           [-1.0, -1.0, -1.0, -1.0]])
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist() == [1, 0, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_nan_row_marks_only_its_sequence(temperature):
    """A row of NaN logits fails its sequence; the batch's other rows are sampled as ever."""
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=1)
    seqs = [Sequence(Request(f"r{i}", "m", [1], params), params.new_generator(
        torch.device("cpu"))) for i in range(3)]
    logits = torch.full((3, 8), -5.0)
    logits[0, 3] = logits[2, 6] = 20.0            # sharp rows: any sampler picks these
    logits[1, 2] = float("nan")
    out = ModelRunner._sample(seqs, logits)
    assert [s.nan for s in out] == [False, True, False]
    assert [out[0].token_id, out[2].token_id] == [3, 6]
