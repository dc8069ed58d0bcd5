"""The workload generator's statistics match its parameters; trace replay keeps the trace's
order and relative timing."""

from __future__ import annotations

import numpy as np
import pytest

from mox.bench.loadtest.workload import (
    PROMPT_TOKEN_RANGE,
    LengthDistribution,
    SyntheticWorkload,
    TraceError,
    TraceWorkload,
    gamma_arrivals,
    read_trace,
    zipf_shares,
)


@pytest.mark.parametrize("rate, cv", [(50.0, 1.0), (20.0, 2.0), (5.0, 4.0)])
def test_gamma_arrivals_have_the_rate_and_cv(rate, cv):
    duration = 40_000 / rate                     # ~40k gaps
    times = gamma_arrivals(np.random.default_rng(1), rate, cv, duration)
    gaps = np.diff(times)
    assert np.all(gaps >= 0) and times[-1] < duration
    assert len(times) / duration == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_arrivals_are_stationary_from_the_start():
    """Every window holds rate x its length requests on average, the first one too (a bursty
    process started at an arrival crowds its first seconds)."""
    rate, cv, duration = 0.05, 2.0, 240.0
    runs = [gamma_arrivals(np.random.default_rng(seed), rate, cv, duration)
            for seed in range(4000)]
    assert np.mean([len(t) for t in runs]) == pytest.approx(rate * duration, rel=0.05)
    assert np.mean([np.sum(t < 10.0) for t in runs]) == pytest.approx(rate * 10.0, rel=0.1)


def test_zipf_shares_and_per_model_rates():
    models = [f"m{i}" for i in range(8)]
    expected = zipf_shares(8, 1.0)
    assert expected.sum() == pytest.approx(1.0)
    assert expected[0] / expected[1] == pytest.approx(2.0)            # rank^-alpha
    reqs = SyntheticWorkload(rate=40.0, duration_s=2000.0, alpha=1.0, cv=1.0).requests(models)
    counts = np.array([sum(r.model == m for r in reqs) for m in models])
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.01)
    assert len(reqs) / 2000.0 == pytest.approx(40.0, rel=0.03)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert [r.index for r in reqs] == list(range(len(reqs)))


def test_zipf_exponent_zero_is_uniform():
    np.testing.assert_allclose(zipf_shares(5, 0.0), 0.2)


def test_lengths_follow_their_distribution_and_prompts_are_valid():
    dist = LengthDistribution(mean=100, cv=0.5, minimum=1, maximum=10_000)
    values = dist.sample(np.random.default_rng(0), 50_000)
    assert values.mean() == pytest.approx(100, rel=0.02)
    assert values.std() / values.mean() == pytest.approx(0.5, rel=0.05)
    clipped = LengthDistribution(32, 1.0, 4, 64).sample(np.random.default_rng(0), 1000)
    assert clipped.min() >= 4 and clipped.max() <= 64
    assert (LengthDistribution(7, 0.0, 1, 9).sample(np.random.default_rng(0), 3) == 7).all()
    spec = SyntheticWorkload(rate=5.0, duration_s=10.0).requests(["a", "b"])[0]
    ids = spec.prompt_token_ids()
    assert len(ids) == spec.num_prompt_tokens and ids == spec.prompt_token_ids()
    assert all(PROMPT_TOKEN_RANGE[0] <= t < PROMPT_TOKEN_RANGE[1] for t in ids)


def test_synthetic_workload_is_deterministic_per_seed():
    make = lambda seed: SyntheticWorkload(rate=3.0, duration_s=30.0, seed=seed).requests(
        ["a", "b", "c"])
    assert make(0) == make(0)
    assert make(0) != make(1)
    assert len(SyntheticWorkload(3.0, 30.0, max_requests=5).requests(["a"])) == 5


def _write_trace(path, rows, header="TIMESTAMP,model,input_tokens,output_tokens"):
    path.write_text(header + "\n" + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return str(path)


def test_trace_keeps_order_relative_timing_and_maps_models_round_robin(tmp_path):
    rows = [("2023-11-16 18:15:46.6805900", "gpt-a", 374, 44),
            ("2023-11-16 18:15:46.9000000", "gpt-b", 396, 109),
            ("2023-11-16 18:15:47.1805900", "gpt-c", 879, 20),
            ("2023-11-16 18:15:48.6805900", "gpt-a", 91, 16),
            ("2023-11-16 18:15:50.1805900", "gpt-d", 1000, 2)]
    path = _write_trace(tmp_path / "azure.csv", rows)
    reqs = TraceWorkload(path).requests(["m0", "m1", "m2"])
    np.testing.assert_allclose([r.arrival_s for r in reqs], [0.0, 0.21941, 0.5, 2.0, 3.5],
                               atol=1e-6)
    assert [r.model for r in reqs] == ["m0", "m1", "m2", "m0", "m0"]     # round-robin
    assert [(r.num_prompt_tokens, r.max_tokens) for r in reqs] == [
        (374, 44), (396, 109), (879, 20), (91, 16), (1000, 2)]
    fast = TraceWorkload(path, speedup=2.0, duration_s=1.5,
                         max_output_tokens=32).requests(["m0", "m1", "m2"])
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.109705, 0.25, 1.0], abs=1e-6)
    assert [r.max_tokens for r in fast] == [32, 32, 20, 16]


def test_trace_in_seconds_sorts_stably_and_rejects_bad_files(tmp_path):
    path = _write_trace(tmp_path / "t.csv", [(10.5, "x", 5, 6), (10.0, "y", 7, 8),
                                             (10.5, "z", 9, 1)])
    assert [r[1] for r in read_trace(path)] == ["y", "x", "z"]
    reqs = TraceWorkload(path).requests(["a", "b"])
    assert [(r.arrival_s, r.model) for r in reqs] == [(0.0, "a"), (0.5, "b"), (0.5, "a")]
    with pytest.raises(TraceError, match="input_tokens"):
        TraceWorkload(_write_trace(tmp_path / "bad.csv", [(1, "x", 2)],
                                   header="timestamp,model,output_tokens")).requests(["a"])
    with pytest.raises(TraceError, match="bad2.csv:2"):
        TraceWorkload(_write_trace(tmp_path / "bad2.csv", [(1, "x", "many", 2)])
                      ).requests(["a"])
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_write_trace(tmp_path / "empty.csv", []))


def test_a_bad_trace_is_one_line_before_any_model_is_built(tmp_path, capsys):
    from mox.cli import main

    bad = _write_trace(tmp_path / "bad.csv", [(1, "x", "abc", 2)])
    assert main(["bench", "--trace", bad, "--home", str(tmp_path / "home")]) == 2
    err = capsys.readouterr().err
    assert "bad.csv:2" in err and "Traceback" not in err
    assert not (tmp_path / "home").exists()


def test_a_trace_replays_whole_unless_a_duration_cuts_it(tmp_path):
    from mox.cli import build_parser
    from mox.cli_bench import TRACE_TAIL_S, bench_config

    trace = _write_trace(tmp_path / "t.csv", [(0, "a", 5, 5), (100, "b", 5, 5),
                                              (300, "a", 5, 5)])
    parse = lambda *extra: bench_config(build_parser().parse_args(
        ["bench", "--trace", trace, "--trace-speedup", "2", *extra]))
    assert parse().duration_s == 150 + TRACE_TAIL_S       # the last arrival, at 300 / 2
    assert parse("--duration", "60").duration_s == 60


def test_a_length_option_keeps_its_mean_through_the_clipping():
    from mox.cli import build_parser
    from mox.cli_bench import bench_config

    config = bench_config(build_parser().parse_args(["bench", "--output-tokens", "100"]))
    assert (config.output.mean, config.output.maximum) == (100, 200)   # the full mode's 2x
    lengths = config.output.sample(np.random.default_rng(0), 20_000)
    assert lengths.mean() == pytest.approx(100, rel=0.05)
