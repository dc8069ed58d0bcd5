"""Load-test summaries: each policy's raw run (per-request records and metric scrapes) turned
into the Summary, PolicyResult and Targets of results.json.

Definitions. A policy's *makespan* runs from the replay's start to the last request's end,
a failed one's included (a request failing late must not shorten it); throughput (output
tokens/s, requests/s) and goodput (requests/s that met every SLO) are counted over it.
Latency percentiles are over the requests that succeeded, so a policy that fails more than
`MAX_FAILED_SHARE` of its requests meets no target (failing its slow requests would
otherwise improve its tail). TPOT = (e2e - TTFT) / (tokens - 1). A request is cold if its
model was cold or loading at arrival (or it was the model's first request). Pager figures
are the server's counters over the replay (last scrape minus the one before the replay);
peak resident bytes are the largest sum over models of `mox:resident_expert_bytes` in any
scrape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mox.bench.loadtest.loadgen import PAGE_CACHE_METRIC, MetricsSample, RequestResult
from mox.bench.loadtest.results_schema import (
    SCHEMA_VERSION,
    SLO,
    BenchConfig,
    Counts,
    Latency,
    ModelResult,
    Pager,
    PolicyResult,
    ReplicaResult,
    RequestRecord,
    Results,
    Suite,
    Summary,
    Target,
    TimelinePoint,
    Workload,
)
from mox.bench.loadtest.routing_stats import RoutingStats
from mox.bench.loadtest.workload import SuitePlan
from mox.bench.machine import describe

# The targets, same run and budget: (figure, baseline, bound, the ratio is at most it)
TARGETS = (("goodput", "model-swap", 1.5, False), ("goodput", "all-resident", 0.8, False),
           ("TPOT p50", "all-resident", 1.3, True), ("TPOT p99", "all-resident", 2.0, True),
           ("TTFT p99", "model-swap", 1 / 3, True), ("TTFT p99", "lru", 1.0, True),
           ("bytes read", "model-swap", 0.5, True))
FIGURES = {"goodput": lambda p: p.goodput_requests_per_s,
           "TPOT p50": lambda p: p.latency.tpot.p50, "TPOT p99": lambda p: p.latency.tpot.p99,
           "TTFT p99": lambda p: p.latency.ttft.p99, "bytes read": lambda p: p.pager.bytes_read}
# A Ray run (`mox bench --ray N`) against rate in one process with the whole budget: its
# goodput ratio, and the share of its requests that landed where their model was warm.
FLEET_GOODPUT, FLEET_WARM_SHARE = 0.9, 0.9
MAX_ERROR_KINDS = 5
MAX_FAILED_SHARE = 0.01
RECORD_DECIMALS = 4               # 0.1 ms: far below what a 2-core CPU run resolves


@dataclass
class RunRecord:
    """One policy's raw run, as the harness measured it."""

    policy: str
    results: list[RequestResult]
    samples: list[MetricsSample]
    baseline: MetricsSample | None
    final: MetricsSample | None
    startup_s: float
    exit_code: int | None
    error: str | None = None
    load_average_1m: float | None = None
    replicas: list[ReplicaResult] = field(default_factory=list)   # a Ray run's, at its end
    origin_monotonic_s: float | None = None    # the replay's start, on the server's clock

    def headline(self) -> str:
        if self.error:
            return f"error: {self.error[:200]}"
        ok = [r for r in self.results if r.is_ok]
        ttft = summary([r.ttft_s for r in ok])
        p99 = "-" if ttft.p99 is None else f"{ttft.p99:.2f}"
        load = "" if self.load_average_1m is None else f", load {self.load_average_1m:.1f}"
        return f"{len(ok)}/{len(self.results)} ok, TTFT p99 {p99} s{load}"


# ---- summaries -----------------------------------------------------------------------------
def summary(values: list[float]) -> Summary:
    if not values:
        return Summary(0)
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Summary(len(a), float(a.mean()), float(p50), float(p90), float(p99))


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    tpot = r.tpot_s
    return (r.is_ok and r.ttft_s * 1e3 <= slo.ttft_ms
            and (tpot is None or tpot * 1e3 <= slo.tpot_ms))


def latency(results: list[RequestResult]) -> Latency:
    ok = [r for r in results if r.is_ok]
    return Latency(summary([r.ttft_s for r in ok]),
                   summary([r.tpot_s for r in ok if r.tpot_s is not None]),
                   summary([x for r in ok for x in r.itl_s]), summary([r.e2e_s for r in ok]),
                   summary([r.ttft_s for r in ok if r.cold]),
                   summary([r.ttft_s for r in ok if not r.cold]))


def counts(results: list[RequestResult], slo: SLO) -> Counts:
    ok = [r for r in results if r.is_ok]
    return Counts(len(results), len(ok), len(results) - len(ok), sum(r.cold for r in results),
                  sum(meets_slo(r, slo) for r in results),
                  sum(r.num_output_tokens for r in ok))


def pager(run: RunRecord, models: list[str]) -> Pager:
    delta = lambda metric: sum(run.final.value(metric, m) - run.baseline.value(metric, m)
                               for m in models)
    hits, misses = int(delta("mox:expert_hits_total")), int(delta("mox:expert_misses_total"))
    peak = max((sum(s.value("mox:resident_expert_bytes", m) for m in models)
                for s in run.samples), default=0.0)
    return Pager(hits, misses, hits / (hits + misses) if hits + misses else None,
                 int(delta("mox:expert_bytes_read_total")), int(peak),
                 int(delta("mox:expert_bytes_read_disk_total")),
                 int(delta("mox:expert_bytes_read_host_total")),
                 int(delta("mox:expert_prefetches_total")),
                 int(delta("mox:expert_prefetch_hits_total")),
                 int(delta("mox:expert_preloads_total")))


def makespan(results: list[RequestResult]) -> float:
    return max((r.ended_s for r in results if r.ended_s is not None), default=0.0)


def error_kinds(results: list[RequestResult]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            kind = r.error[:80]
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:MAX_ERROR_KINDS])


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, RECORD_DECIMALS)


def request_record(r: RequestResult, slo: SLO) -> RequestRecord:
    return RequestRecord(r.index, r.model, _round(r.arrival_s), _round(r.sent_s), r.cold,
                         r.num_prompt_tokens, r.num_output_tokens, meets_slo(r, slo),
                         _round(r.ttft_s), _round(r.tpot_s), _round(r.e2e_s), r.error)


def summarize_policy(run: RunRecord, models: list[str], slo: SLO) -> PolicyResult:
    if run.error is not None:
        return PolicyResult(policy=run.policy, error=run.error)
    span = makespan(run.results) or 1.0
    per_model = []
    for m in models:
        mine = [r for r in run.results if r.model == m]
        c = counts(mine, slo)
        per_model.append(ModelResult(m, c, c.output_tokens / span, c.met_slo / span,
                                     latency(mine), pager(run, [m])))
    c = counts(run.results, slo)
    timeline = [TimelinePoint(s.t_s, s.value("mox:device_used_bytes"),
                              {m: s.value("mox:resident_expert_bytes", m) for m in models},
                              {m: s.value("mox:request_rate", m) for m in models},
                              s.value(PAGE_CACHE_METRIC),
                              sum(s.value("mox:expert_bytes_read_total", m) for m in models))
                for s in run.samples]
    return PolicyResult(
        policy=run.policy, server_exit_code=run.exit_code, startup_s=run.startup_s,
        makespan_s=span, load_average_1m=run.load_average_1m, counts=c,
        throughput_tokens_per_s=c.output_tokens / span,
        throughput_requests_per_s=c.ok / span, goodput_requests_per_s=c.met_slo / span,
        latency=latency(run.results), pager=pager(run, models),
        peak_device_used_bytes=int(max((p.device_used_bytes for p in timeline), default=0)),
        peak_page_cache_bytes=int(max((p.page_cache_bytes for p in timeline), default=0)),
        errors=error_kinds(run.results), per_model=per_model, timeline=timeline,
        requests=[request_record(r, slo) for r in run.results], replicas=run.replicas,
        origin_monotonic_s=run.origin_monotonic_s)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(policies: list[PolicyResult]) -> list[Target]:
    """The issue's targets on the policies that ran without error."""
    ok = {p.policy: p for p in policies if p.error is None}
    out = []
    for figure, baseline, bound, at_most in TARGETS:
        target = Target(figure, baseline, bound, at_most)
        if "rate" in ok and baseline in ok:
            mine, theirs = FIGURES[figure](ok["rate"]), FIGURES[figure](ok[baseline])
            ratio = _ratio(mine, theirs)
            if ratio is None and mine and theirs == 0:
                ratio = float("inf")           # e.g. the baseline met no SLO at all
            if ratio is not None:
                target.ratio = ratio
                target.met = (ratio <= bound if at_most else ratio >= bound) and (
                    failed_share(ok["rate"]) <= MAX_FAILED_SHARE)
        out.append(target)
    return out + fleet_targets(ok)


def failed_share(policy: PolicyResult) -> float:
    c = policy.counts
    return c.failed / c.requests if c is not None and c.requests else 0.0


def fleet_targets(ok: dict[str, PolicyResult]) -> list[Target]:
    """A Ray run's goodput against rate's in one process, and its warm-routed share."""
    out = []
    for fleet in [p for p in ok.values() if p.replicas]:
        goodput = Target(f"{fleet.policy} goodput", "rate", FLEET_GOODPUT, False)
        if "rate" in ok:
            goodput.ratio = _ratio(fleet.goodput_requests_per_s,
                                   ok["rate"].goodput_requests_per_s)
            goodput.met = None if goodput.ratio is None else (
                goodput.ratio >= FLEET_GOODPUT and failed_share(fleet) <= MAX_FAILED_SHARE)
        share = fleet.warm_share
        out += [goodput, Target(f"{fleet.policy} requests landing where warm (share)", "-",
                                FLEET_WARM_SHARE, False, share,
                                None if share is None else (share >= FLEET_WARM_SHARE and
                                                            failed_share(fleet)
                                                            <= MAX_FAILED_SHARE))]
    return out


def workload_summary(plan: SuitePlan) -> Workload:
    reqs = plan.requests
    span = max((r.arrival_s for r in reqs), default=0.0)
    shares = {m: sum(r.model == m for r in reqs) / max(1, len(reqs)) for m in plan.models}
    return Workload(len(reqs), len(reqs) / span if span else 0.0,
                    float(np.mean([r.num_prompt_tokens for r in reqs])) if reqs else 0.0,
                    float(np.mean([r.max_tokens for r in reqs])) if reqs else 0.0, shares)


def summarize_suite(config: BenchConfig, plan: SuitePlan, routing: RoutingStats | None,
                    runs: list[RunRecord]) -> Suite:
    models = list(plan.models)
    policies = [summarize_policy(run, models, config.slo) for run in runs]
    return Suite(plan.name, plan.routing_skew, models, plan.dense_bytes, plan.expert_bytes,
                 plan.device_budget_bytes, workload_summary(plan), routing, policies,
                 targets(policies))


def build_results(config: BenchConfig, suites: list[Suite], wall_s: float) -> Results:
    return Results(SCHEMA_VERSION, time.strftime("%Y-%m-%dT%H:%M:%S%z"), describe(), wall_s,
                   config, suites)
