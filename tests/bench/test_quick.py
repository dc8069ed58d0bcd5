"""`mox bench --quick` end to end (two policies, to keep the suite fast; the CLI's --quick
runs this code path with all four): results.json validates against the documented schema,
and the Markdown and plots are written. Plus the pieces the report is made of."""

from __future__ import annotations

import os
import shutil

import msgspec
import numpy as np
import pytest

from mox.bench.loadtest.results_schema import (
    SLO,
    Counts,
    PolicyResult,
    Results,
    Suite,
    Summary,
    Workload,
)
from mox.bench.loadtest.routing_stats import layer_statistics, lru_hit_rate, routing_statistics
from mox.bench.loadtest.summaries import meets_slo, summary, targets
from mox.cli import main
from mox.cli_bench import parse_slo
from mox.errors import InvalidRequestError
from mox.router.timeline import read_log

PAGE_CACHE_SLACK_PER_MODEL = 1 << 20        # readahead of the shards' header reads


def test_quick_bench_runs_end_to_end_and_validates(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "--quick", "--home", str(tmp_path / "home"), "--out", str(out),
                 "--policies", "rate", "model-swap"])
    assert code == 0
    results = msgspec.json.decode((out / "results.json").read_bytes(), type=Results)
    assert results.config.quick and results.config.policies == ["rate", "model-swap"]
    (suite,) = results.suites
    assert suite.name == "uniform" and len(suite.models) == 4
    assert suite.device_budget_bytes < suite.dense_bytes + suite.expert_bytes
    assert suite.routing is not None and 0 < suite.routing.mean_entropy <= 1
    for policy in suite.policies:
        assert policy.error is None and policy.server_exit_code == 0
        # all of them finish on an idle machine; a busy shared one may run past the deadline
        assert policy.counts.requests == suite.workload.num_requests > 0
        # the counts and the TTFT percentiles agree with the per-request records
        ok = [r for r in policy.requests if r.error is None and r.ttft_s is not None]
        assert policy.counts.ok == len(ok) >= 1
        assert policy.counts.failed == sum(r.error is not None for r in policy.requests)
        ttfts = [r.ttft_s for r in ok]                     # rounded to 0.1 ms in the records
        assert policy.latency.ttft.p50 == pytest.approx(np.percentile(ttfts, 50), abs=2e-4)
        assert policy.latency.ttft.p99 == pytest.approx(np.percentile(ttfts, 99), abs=2e-4)
        assert policy.latency.ttft.p50 > 0
        assert policy.counts.cold >= 1                 # every model starts cold
        assert policy.pager.bytes_read > 0 and policy.timeline
        assert policy.pager.bytes_read_disk == policy.pager.bytes_read    # no host cache on CPU
        # honest tiers: the weights read (O_DIRECT) stay out of the page cache, within the host
        # budget (none here) plus what reading the headers pulls in ahead
        assert policy.peak_page_cache_bytes <= 4 * PAGE_CACHE_SLACK_PER_MODEL
        assert len(policy.requests) == policy.counts.requests
        assert sum(m.counts.requests for m in policy.per_model) == policy.counts.requests
    found = {(t.figure, t.baseline): t for t in suite.targets}
    assert found["TTFT p99", "model-swap"].ratio is not None
    assert found["goodput", "all-resident"].ratio is None        # not run
    markdown = (out / "results.md").read_text()
    assert "| rate |" in markdown and "| TTFT p99 vs model-swap |" in markdown
    assert "| uniform-rate |" in markdown                      # the per-step timeline table
    # how far the client's sends lagged the schedule (TTFT counts from the send)
    assert "Sends behind the arrival schedule, p99 ms (TTFT counts from the send): rate " \
        in markdown
    from mox.bench.loadtest.tail import decode_table, slowest, ttft_table

    rate = suite.policies[0]
    worst = slowest(rate.requests, read_log(str(out / "logs" / "uniform-rate.steps.jsonl"))[0],
                    rate.origin_monotonic_s, n=1)[0]     # its prompt step found in the log
    assert 0 < worst.before_step_s + worst.step_s <= worst.ttft_s + 0.05 and worst.step_s > 0
    assert "| uniform-rate | #" in ttft_table(str(out)) and "## The slowest first" in markdown
    assert "| uniform-model-swap |" in decode_table(str(out)) and "## Where decode" in markdown
    from mox.bench.loadtest.cold_starts import cold_start

    # every model starts cold: its first requests waited on its load, and the split of their
    # first tokens (admission, load, queued, the prompt's step) fits inside each TTFT
    swap = suite.policies[1]
    steps, events = read_log(str(out / "logs" / "uniform-model-swap.steps.jsonl"))
    starts = [c for r in swap.requests
              if (c := cold_start(r, steps, events, swap.origin_monotonic_s))]
    assert len({swap.requests[c.index].model for c in starts}) >= 2, starts
    assert all(c.load_s > 0 and c.step_s > 0 and
               c.admission_s + c.load_s + c.queued_s + c.step_s <= c.ttft_s + 0.1
               for c in starts), starts
    assert "| uniform-model-swap |" in markdown and "## Cold starts" in markdown
    from mox.bench.loadtest.two_runs import compare

    side_by_side = compare([str(out), str(out)])              # two runs' figures, "a / b"
    rate = suite.policies[0]
    p50, sent = rate.latency.ttft.p50, f"{rate.counts.ok}/{rate.counts.requests}"
    assert f"| rate | {sent} / {sent} | {p50:.2f} / {p50:.2f} |" in side_by_side
    renamed = out / "renamed"                  # a run whose only suite another run lacks
    renamed.mkdir()
    (renamed / "results.json").write_text(
        (out / "results.json").read_text().replace('"name":"uniform"', '"name":"skew1"'))
    mixed = compare([str(out), str(renamed)])
    assert "### uniform routing" in mixed and "### skew1 routing" in mixed
    assert mixed.count("1 of the 2 runs") == 2 and f"| rate | {sent} | {p50:.2f} |" in mixed
    for plot in ("ttft-cdf", "tpot-cdf", "bytes-read", "resident-bytes", "request-rate"):
        assert os.path.getsize(out / f"uniform-{plot}.png") > 1000


def test_slo_parsing():
    assert parse_slo(["ttft:500", "tpot:50"]) == (500.0, 50.0)
    assert parse_slo("tpot:5 ttft:7.5") == (7.5, 5.0)
    for bad in ("ttft:500", "ttft:x tpot:1", "e2e:3 tpot:1", "ttft:-5 tpot:100",
                "ttft:0 tpot:0", "ttft:inf tpot:1"):
        with pytest.raises(InvalidRequestError):
            parse_slo(bad)


def test_summary_goodput_rule_and_target_ratios():
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert (s.count, s.mean, s.p50) == (4, 2.5, 2.5) and s.p99 == pytest.approx(3.97)
    assert summary([]) == Summary(0)
    from mox.bench.loadtest.loadgen import RequestResult

    fast = RequestResult(index=0, model="a", arrival_s=0, sent_s=0, num_prompt_tokens=1,
                         max_tokens=3, cold=False, ttft_s=0.1, e2e_s=0.3,
                         num_output_tokens=3)
    assert fast.tpot_s == pytest.approx(0.1)
    assert meets_slo(fast, SLO(200, 100.1)) and not meets_slo(fast, SLO(200, 99))
    assert not meets_slo(fast, SLO(50, 1000))

    def policy(name, p99, goodput, tpot, nbytes):
        from mox.bench.loadtest.results_schema import Counts, Latency, Pager

        ttft, tpots = Summary(1, p99, p99, p99, p99), Summary(1, tpot, tpot, tpot, tpot)
        return PolicyResult(policy=name, counts=Counts(1, 1, 0, 0, 1, 1),
                            latency=Latency(ttft, tpots, ttft, ttft, ttft, ttft),
                            goodput_requests_per_s=goodput,
                            pager=Pager(0, 0, None, nbytes, 0))

    found = {(t.figure, t.baseline): t for t in targets(
        [policy("rate", 1.0, 4.0, 0.1, 100), policy("model-swap", 4.0, 1.0, 0.05, 400),
         policy("all-resident", 0.5, 5.0, 0.09, 0)])}
    assert found["TTFT p99", "model-swap"].ratio == 0.25 and found["TTFT p99", "model-swap"].met
    assert found["goodput", "model-swap"].ratio == 4.0 and found["goodput", "model-swap"].met
    assert found["goodput", "all-resident"].ratio == 0.8 and found["goodput", "all-resident"].met
    assert found["TPOT p50", "all-resident"].ratio == pytest.approx(1.11, abs=0.01)
    assert found["bytes read", "model-swap"].met and found["bytes read", "model-swap"].ratio == 0.25
    assert found["TTFT p99", "lru"].ratio is None and found["TTFT p99", "lru"].met is None
    # a baseline that met no SLO: rate's goodput is infinitely better, not undefined
    zero = {(t.figure, t.baseline): t for t in targets(
        [policy("rate", 1.0, 4.0, 0.1, 1), policy("model-swap", 4.0, 0.0, 0.1, 1)])}
    assert zero["goodput", "model-swap"].ratio == float("inf")
    # a policy failing more than 1% of its requests meets no target: failing its slow
    # requests would improve its latency figures, which count the ones that succeeded
    failing = policy("rate", 1.0, 4.0, 0.1, 100)
    failing.counts = Counts(100, 98, 2, 0, 98, 98)
    found = {(t.figure, t.baseline): t for t in targets(
        [failing, policy("model-swap", 4.0, 1.0, 0.05, 400)])}
    assert found["goodput", "model-swap"].ratio == 4.0
    assert not found["goodput", "model-swap"].met and not found["TTFT p99", "model-swap"].met


def test_the_makespan_ends_with_the_last_request_failed_or_not():
    from mox.bench.loadtest.loadgen import RequestResult
    from mox.bench.loadtest.summaries import makespan

    done = lambda **kw: RequestResult(index=0, model="a", arrival_s=0, sent_s=0,
                                      num_prompt_tokens=1, max_tokens=1, cold=False, **kw)
    assert makespan([done(ttft_s=0.1, e2e_s=1.0, ended_s=1.0),
                     done(error="HTTP 503", ended_s=5.0)]) == 5.0


def test_two_runs_shows_counts_and_a_missing_figure_as_a_dash():
    from mox.bench.loadtest.results_schema import Latency, Pager
    from mox.bench.loadtest.two_runs import policy_table

    empty = PolicyResult(policy="rate", counts=Counts(3, 0, 3, 0, 0, 0),
                         latency=Latency(*[Summary(0)] * 6), pager=Pager(0, 0, None, 0, 0))
    suite = Suite("uniform", 0.0, ["a"], 0, 0, 0, Workload(3, 1.0, 8, 8, {}), None, [empty], [])
    row = policy_table([suite, suite])[2]
    assert row.startswith("| rate | 0/3 / 0/3 | - / - |")


def test_a_ray_runs_targets_compare_with_rate_in_one_process():
    from mox.bench.loadtest.report import fleet_table
    from mox.bench.loadtest.results_schema import Latency, ReplicaResult, Workload

    replicas = [ReplicaResult("r0", {"a": 10, "b": 2}, {"a": 9, "b": 2}, {"a": 1.0},
                              {"a": 10, "b": 1}, {"a": 1}),
                ReplicaResult("r1", {"c": 8}, {"c": 7}, {"c": 0.75}, {"c": 8}, {})]
    fleet = PolicyResult(policy="rate-ray2", goodput_requests_per_s=0.45, replicas=replicas)
    assert fleet.warm_share == 0.9 and fleet.held_share == 0.95
    assert fleet.routed_warm_share == 18 / 19          # one of 19 could have found it warm
    found = {t.figure: t for t in targets(
        [PolicyResult(policy="rate", goodput_requests_per_s=0.5), fleet])}
    goodput = found["rate-ray2 goodput"]
    assert goodput.baseline == "rate" and goodput.ratio == pytest.approx(0.9) and goodput.met
    share = found["rate-ray2 requests landing where warm (share)"]
    assert share.ratio == 0.9 and share.met
    suite = Suite("uniform", 0.0, ["a", "b", "c"], 0, 0, 0, Workload(20, 1.0, 8, 8, {}),
                  None, [fleet], [])
    table = "\n".join(fleet_table(suite))
    assert "90% of requests landed" in table and "95% on one that held it" in table
    assert "was warm on some replica (by the replicas' reports, up to two seconds old), 95% " \
        "landed where it was warm" in table
    one = PolicyResult(policy="rate", latency=Latency(*[Summary(1)] * 4, cold_ttft=Summary(3),
                                                      warm_ttft=Summary(9)))
    suite = Suite("uniform", 0.0, ["a", "b", "c"], 0, 0, 0, Workload(20, 1.0, 8, 8, {}),
                  None, [one, fleet], [])
    assert "In one process (rate, the whole budget) 75% found their model warm." in \
        "\n".join(fleet_table(suite))
    assert "| r0 | a 9/10/10, b 2/1/2 | a 1.00 |" in table and "| r1 | c 7/8/8 | c 0.75 |" in table


def test_routing_statistics_on_known_patterns():
    rng = np.random.default_rng(0)
    uniform = [np.stack([rng.choice(16, 2, replace=False) for _ in range(4000)])]
    sticky = [np.tile([[1, 2]], (100, 1))]
    u = layer_statistics(0, uniform, 16)
    s = layer_statistics(0, sticky, 16)
    assert u.entropy > 0.99 and u.previous_token_overlap == pytest.approx(2 / 16, abs=0.01)
    assert u.lru_quarter_hit_rate == pytest.approx(0.25, abs=0.03)
    assert s.entropy == pytest.approx(1 / 4)           # two of 16 experts: log 2 / log 16
    assert s.previous_token_overlap == 1.0 and s.lru_quarter_hit_rate == 0.99
    assert lru_hit_rate([np.array([[0], [1], [0], [2], [1]])], capacity=2) == 0.2
    stats = routing_statistics("m", {0: uniform, 1: sticky}, 16, 2)
    assert stats.num_tokens == 4000 and stats.uniform_overlap == 2 / 16
    assert stats.mean_entropy == pytest.approx((u.entropy + s.entropy) / 2)


def test_all_resident_is_refused_where_the_weights_exceed_ram():
    from mox.bench.loadtest.harness import unrunnable
    from mox.bench.loadtest.workload import SuitePlan

    plan = SuitePlan("uniform", 0.0, {"a": "/a", "b": "/b"}, 2 << 30, 30 << 30, 10 << 30, [])
    assert "32.0 GiB" in unrunnable(plan, "all-resident", ram=24 << 30)
    assert unrunnable(plan, "rate", ram=24 << 30) is None
    assert unrunnable(plan, "all-resident", ram=64 << 30) is None


def test_step_summary_reads_a_step_log(tmp_path):
    from mox.bench.loadtest.step_summary import summarize, table
    from mox.router.timeline import ModelEvent, StepRecord, replica_step_log

    records = [ModelEvent("load", 0.0, "a", preload=64, stream=True),     # events are skipped
               StepRecord(0.0, "a", 2, 40, 40, 0.5, 0.4, 0.1, 8, 2, 8 << 20),
               StepRecord(0.5, "a", 2, 2, 0, 0.1, 0.08),
               StepRecord(12.0, "b", 1, 1, 0, 0.3, 0.1, 0.2, 2, 1, 2 << 20),
               StepRecord(12.3, "c", 1, 1, 0, 0.5, 0.1, 0.0, 1, 1, 1 << 20,
                          parked_seconds=0.4, slots=12, run_slots=16)]
    path = tmp_path / "uniform-rate.steps.jsonl"
    path.write_bytes(b"\n".join(msgspec.json.encode(r) for r in records) + b"\n")
    s = summarize(read_log(str(path))[0])
    assert (s.steps, s.prefill_steps, s.misses) == (4, 1, 11)
    assert s.span_s == pytest.approx(12.8)
    assert s.busy_s == pytest.approx(1.0)               # c's parked time is not busy
    assert s.decode_ms_mean == pytest.approx(300) and s.decode_seqs_mean == 4 / 3
    assert (s.decode_missing, s.decode_below_run) == (2, 1)    # b, c missed; c below its run
    assert s.stall_s == pytest.approx(0.3) and s.parked_s == pytest.approx(0.4)
    assert s.read_mib == 11
    assert s.models_per_10s == 1.5                      # a alone, then b and c
    assert "| uniform-rate | 4 |" in table(str(tmp_path))
    # a report names its run's logs: one an earlier run left in the folder is not its own
    (tmp_path / "uniform-lru.steps.jsonl").write_bytes(path.read_bytes())
    assert "uniform-lru" in table(str(tmp_path))
    assert "uniform-lru" not in table(str(tmp_path), ["uniform-rate"])
    # a fleet's replicas each write their own, named as the report looks for them
    replica = replica_step_log(str(tmp_path / "uniform-rate-ray2.steps.jsonl"), "r0")
    assert replica == str(tmp_path / "uniform-rate-ray2-r0.steps.jsonl")
    shutil.copyfile(path, replica)
    assert "| uniform-rate-ray2-r0 |" in table(str(tmp_path),
                                               [replica_step_log("uniform-rate-ray2", "*")])


def test_a_quantized_suite_serves_quantized_copies_at_the_bf16_budget(tmp_path):
    import argparse

    from mox.bench.loadtest.harness import plan_suite
    from mox.cli_bench import add_bench_parser, bench_config

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--quick", "--home", str(tmp_path), "--models", "2",
                              "--quantize", "int8"])
    config = bench_config(args)
    quantized = plan_suite(config, 0.0)
    plain = plan_suite(msgspec.structs.replace(config, quantize=None), 0.0)
    assert quantized.device_budget_bytes == plain.device_budget_bytes
    assert quantized.expert_bytes < 0.55 * plain.expert_bytes
    for name, path in quantized.models.items():
        assert path != plain.models[name] and path.endswith(".int8")


def test_an_expert_major_suite_repacks_its_models_in_place_once(tmp_path):
    """`--expert-major`: the built models are repacked as `mox models import` leaves them, at
    the same paths, holding the same tensors; a second plan finds them done."""
    import argparse

    from mox.bench.loadtest.harness import plan_suite
    from mox.cli_bench import add_bench_parser, bench_config
    from mox.loaders import Checkpoint
    from mox.loaders.repack import is_expert_major
    from mox.model_import import check_same_tensors

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    argv = ["bench", "--quick", "--home", str(tmp_path), "--models", "2"]
    plain = plan_suite(bench_config(parser.parse_args(argv)), 0.0)
    originals = {}
    for name, path in plain.models.items():
        assert not is_expert_major(Checkpoint(path))
        originals[name] = str(tmp_path / f"{name}-original")
        shutil.copytree(path, originals[name])
    config = bench_config(parser.parse_args([*argv, "--expert-major"]))
    repacked = plan_suite(config, 0.0)
    assert repacked.models == plain.models
    for name, path in repacked.models.items():
        assert is_expert_major(Checkpoint(path))
        check_same_tensors(originals[name], path)
        mtime = os.stat(os.path.join(path, "config.json")).st_mtime_ns
        assert plan_suite(config, 0.0).models[name] == path
        assert os.stat(os.path.join(path, "config.json")).st_mtime_ns == mtime


def test_requests_sent_before_their_models_first_token_are_first_touches():
    from mox.bench.loadtest.report import fleet_table
    from mox.bench.loadtest.results_schema import ReplicaResult, RequestRecord, Workload

    def sent(model: str, at: float, ttft: float | None) -> RequestRecord:
        return RequestRecord(0, model, at, at, False, 4, 4, ttft is not None, ttft_s=ttft)

    # a's first token comes at 1.0: the request sent at 0.5 could find it warm nowhere, the
    # one at 2.0 could; b's only request failed, so it never had a first token
    requests = [sent("a", 0.0, 1.0), sent("a", 0.5, 0.6), sent("a", 2.0, 0.1),
                sent("b", 0.2, None)]
    replicas = [ReplicaResult("r0", {"a": 3, "b": 1}, {"a": 1}, {"a": 1.0}, {"a": 3}, {})]
    fleet = PolicyResult(policy="rate-ray2", requests=requests, replicas=replicas)
    assert fleet.first_touches == 3
    suite = Suite("uniform", 0.0, ["a", "b"], 0, 0, 0, Workload(4, 1.0, 4, 4, {}), None,
                  [fleet], [])
    line = fleet_table(suite)[0]
    assert "25% of requests landed" in line and "(100% of the 1 sent after" in line
    assert "3 were sent before" in line
