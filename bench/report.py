"""Load-test results: the schema of results.json (msgspec Structs; `Results` is the whole
file), the summaries computed from each policy's raw run, the Markdown report and the plots.

Definitions. A policy's *makespan* runs from the replay's start to the last response's end;
throughput (output tokens/s, requests/s) and goodput (requests/s that met every SLO) are
counted over it. TPOT = (e2e - TTFT) / (tokens - 1). A request is cold if its model was cold
or loading at arrival (or it was the model's first request). Pager figures are the server's
counters over the replay (last scrape minus the one before the replay); peak resident bytes
are the largest sum over models of `mox:resident_expert_bytes` in any scrape.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from mox.bench.loadgen import MetricsSample, RequestResult
from mox.bench.routing_stats import RoutingStats
from mox.bench.workload import LengthDistribution

if TYPE_CHECKING:
    from mox.bench.harness import SuitePlan

SCHEMA_VERSION = 1
# The targets, same run and budget: rate vs model-swap p99 TTFT and goodput, rate vs
# all-resident throughput.
TARGET_P99_TTFT_VS_SWAP = 1 / 3
TARGET_GOODPUT_VS_SWAP = 2.0
TARGET_THROUGHPUT_VS_RESIDENT = 0.8
MAX_ERROR_KINDS = 5
RECORD_DECIMALS = 4               # 0.1 ms: far below what a 2-core CPU run resolves


class SLO(msgspec.Struct):
    ttft_ms: float
    tpot_ms: float


class BenchConfig(msgspec.Struct, kw_only=True):
    quick: bool
    preset: str                       # demo | mid | bench (mox.demo)
    architecture: str
    num_models: int
    alpha: float
    cv: float
    rate: float                       # total requests/s
    duration_s: float
    prompt: LengthDistribution
    output: LengthDistribution
    device_memory_fraction: float     # of all expert bytes, on top of all dense bytes
    routing_skews: list[float]
    policies: list[str]
    slo: SLO
    trace: str | None = None
    trace_speedup: float = 1.0
    seed: int = 0
    host_memory: str | None = None
    kv_memory: str = "512MiB"
    scrape_period_s: float = 1.0
    routing_sequences: int = 8
    home: str | None = None           # where the models are built (MOX_HOME)
    out: str = "."


class Summary(msgspec.Struct):
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class Latency(msgspec.Struct):
    """Seconds. `cold_ttft`/`warm_ttft`: TTFT of cold / warm arrivals."""

    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    cold_ttft: Summary
    warm_ttft: Summary


class Pager(msgspec.Struct):
    hits: int
    misses: int
    hit_rate: float | None
    bytes_read: int
    peak_resident_bytes: int


class Counts(msgspec.Struct):
    requests: int
    ok: int
    failed: int
    cold: int
    met_slo: int
    output_tokens: int


class ModelResult(msgspec.Struct):
    model: str
    counts: Counts
    throughput_tokens_per_s: float
    goodput_requests_per_s: float
    latency: Latency
    pager: Pager


class TimelinePoint(msgspec.Struct):
    t_s: float
    device_used_bytes: float
    resident_bytes: dict[str, float]
    request_rate: dict[str, float]


class RequestRecord(msgspec.Struct, omit_defaults=True):
    """One request (seconds, rounded to 0.1 ms); `error` set when it failed."""

    index: int
    model: str
    arrival_s: float
    sent_s: float
    cold: bool
    num_prompt_tokens: int
    num_output_tokens: int
    met_slo: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


class PolicyResult(msgspec.Struct, kw_only=True):
    policy: str
    error: str | None = None
    server_exit_code: int | None = None
    startup_s: float = 0.0
    makespan_s: float = 0.0
    load_average_1m: float | None = None    # the machine's, as the replay ended (2 = 2 cores)
    counts: Counts | None = None
    throughput_tokens_per_s: float = 0.0
    throughput_requests_per_s: float = 0.0
    goodput_requests_per_s: float = 0.0
    latency: Latency | None = None
    pager: Pager | None = None
    peak_device_used_bytes: int = 0
    errors: dict[str, int] = {}
    per_model: list[ModelResult] = []
    timeline: list[TimelinePoint] = []
    requests: list[RequestRecord] = []


class Targets(msgspec.Struct):
    """rate / model-swap p99 TTFT (target <= 1/3), rate / model-swap goodput (>= 2),
    rate / all-resident throughput (>= 0.8); None where a policy is missing."""

    p99_ttft_vs_model_swap: float | None
    goodput_vs_model_swap: float | None
    throughput_vs_all_resident: float | None
    met_p99_ttft: bool | None
    met_goodput: bool | None
    met_throughput: bool | None


class Workload(msgspec.Struct):
    num_requests: int
    offered_rate: float               # requests/s over the workload's span
    mean_prompt_tokens: float
    mean_output_tokens: float
    model_shares: dict[str, float]    # measured share of requests per model


class Suite(msgspec.Struct):
    name: str
    routing_skew: float
    models: list[str]
    dense_bytes: int
    expert_bytes: int
    device_budget_bytes: int
    workload: Workload
    routing: RoutingStats | None
    policies: list[PolicyResult]
    targets: Targets


class Results(msgspec.Struct):
    schema_version: int
    created: str
    machine: str
    wall_s: float
    config: BenchConfig
    suites: list[Suite]


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
                 int(delta("mox:expert_bytes_read_total")), int(peak))


def makespan(results: list[RequestResult]) -> float:
    ends = [r.sent_s + r.e2e_s for r in results if r.is_ok]
    return max(ends, default=0.0)


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
                              {m: s.value("mox:request_rate", m) for m in models})
                for s in run.samples]
    return PolicyResult(
        policy=run.policy, server_exit_code=run.exit_code, startup_s=run.startup_s,
        makespan_s=span, load_average_1m=run.load_average_1m, counts=c,
        throughput_tokens_per_s=c.output_tokens / span,
        throughput_requests_per_s=c.ok / span, goodput_requests_per_s=c.met_slo / span,
        latency=latency(run.results), pager=pager(run, models),
        peak_device_used_bytes=int(max((p.device_used_bytes for p in timeline), default=0)),
        errors=error_kinds(run.results), per_model=per_model, timeline=timeline,
        requests=[request_record(r, slo) for r in run.results])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(policies: list[PolicyResult]) -> Targets:
    ok = {p.policy: p for p in policies if p.error is None}
    rate, swap, resident = ok.get("rate"), ok.get("model-swap"), ok.get("all-resident")
    p99 = lambda p: None if p is None else p.latency.ttft.p99
    ttft = _ratio(p99(rate), p99(swap))
    good = None if rate is None or swap is None else _ratio(
        rate.goodput_requests_per_s, swap.goodput_requests_per_s)
    if good is None and rate is not None and swap is not None and rate.counts.met_slo:
        good = float("inf")                # model-swap met no SLO at all
    tput = None if rate is None or resident is None else _ratio(
        rate.throughput_tokens_per_s, resident.throughput_tokens_per_s)
    met = lambda value, check: None if value is None else bool(check(value))
    return Targets(ttft, good, tput, met(ttft, lambda v: v <= TARGET_P99_TTFT_VS_SWAP),
                   met(good, lambda v: v >= TARGET_GOODPUT_VS_SWAP),
                   met(tput, lambda v: v >= TARGET_THROUGHPUT_VS_RESIDENT))


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
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    return Results(SCHEMA_VERSION, time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine, wall_s,
                   config, suites)


# ---- writing -------------------------------------------------------------------------------
RESULTS_FILE, MARKDOWN_FILE = "results.json", "results.md"
MiB = 2**20


def write_report(results: Results, out: str) -> list[str]:
    """results.json, results.md and the plots into `out`; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, RESULTS_FILE), os.path.join(out, MARKDOWN_FILE)]
    with open(paths[0], "wb") as f:
        f.write(msgspec.json.encode(results) + b"\n")
    plots = [p for suite in results.suites for p in plot_suite(suite, out)]
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(results, [os.path.basename(p) for p in plots]))
    return paths + plots


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _x(value: float | None, target: float, at_most: bool) -> str:
    if value is None:
        return "-"
    met = value <= target if at_most else value >= target
    return f"{value:.2f}x ({'met' if met else 'missed'}; target {'<=' if at_most else '>='} " \
           f"{target:.2f}x)"


def policy_table(suite: Suite) -> list[str]:
    rows = ["| policy | ok / sent | cold | TTFT p50 / p90 / p99 ms | cold TTFT p50 ms | "
            "TPOT p50 / p99 ms | e2e p99 ms | tok/s | goodput req/s | expert hit rate | "
            "read MiB | peak resident MiB |", "|---" * 12 + "|"]
    for p in suite.policies:
        if p.error is not None:
            rows.append(f"| {p.policy} | error: {p.error[:120]} |" + " |" * 10)
            continue
        t, lat, pg = p.latency.ttft, p.latency, p.pager
        hit = "-" if pg.hit_rate is None else f"{pg.hit_rate:.2f}"
        rows.append(
            f"| {p.policy} | {p.counts.ok} / {p.counts.requests} | {p.counts.cold} | "
            f"{_ms(t.p50)} / {_ms(t.p90)} / {_ms(t.p99)} | {_ms(lat.cold_ttft.p50)} | "
            f"{_ms(lat.tpot.p50)} / {_ms(lat.tpot.p99)} | {_ms(lat.e2e.p99)} | "
            f"{p.throughput_tokens_per_s:.1f} | {p.goodput_requests_per_s:.2f} | {hit} | "
            f"{pg.bytes_read / MiB:.0f} | {pg.peak_resident_bytes / MiB:.0f} |")
    return rows


def per_model_table(suite: Suite) -> list[str]:
    ok = [p for p in suite.policies if p.error is None]
    rows = ["| model | share | " + " | ".join(f"{p.policy} TTFT p99 ms / goodput" for p in ok)
            + " |", "|---|---|" + "---|" * len(ok)]
    for i, model in enumerate(suite.models):
        cells = [f"{_ms(p.per_model[i].latency.ttft.p99)} / "
                 f"{p.per_model[i].goodput_requests_per_s:.2f}" for p in ok]
        rows.append(f"| {model} | {suite.workload.model_shares[model]:.2f} | "
                    + " | ".join(cells) + " |")
    return rows


def routing_line(routing: RoutingStats | None) -> str:
    if routing is None:
        return "Routing statistics: not measured."
    return (f"Routing ({routing.num_sequences} workload prompts, {routing.num_tokens} tokens, "
            f"E={routing.num_experts}, k={routing.top_k}): popularity entropy "
            f"{routing.mean_entropy:.3f} of uniform; previous-token overlap "
            f"{routing.mean_previous_token_overlap:.3f} (independent uniform: "
            f"{routing.uniform_overlap:.3f}); per-layer LRU of E/4 hits "
            f"{routing.mean_lru_quarter_hit_rate:.2f}.")


def markdown(results: Results, plots: list[str]) -> str:
    c = results.config
    lines = ["# mox bench", "",
             f"{results.created}, {results.machine}, {results.wall_s:.0f} s wall. "
             f"{c.num_models} x {c.architecture} ({c.preset} preset); Zipf alpha {c.alpha}, "
             f"CV {c.cv}, {c.rate} req/s for {c.duration_s:g} s"
             + (f" (trace {c.trace})" if c.trace else "")
             + f"; device budget = dense + {c.device_memory_fraction:g} x experts; "
             f"SLO TTFT {c.slo.ttft_ms:g} ms, TPOT {c.slo.tpot_ms:g} ms.", ""]
    for suite in results.suites:
        w, tg = suite.workload, suite.targets
        lines += [f"## {suite.name} routing (skew {suite.routing_skew:g})", "",
                  f"{len(suite.models)} models: dense {suite.dense_bytes / MiB:.0f} MiB + "
                  f"experts {suite.expert_bytes / MiB:.0f} MiB; device budget "
                  f"{suite.device_budget_bytes / MiB:.0f} MiB. {w.num_requests} requests "
                  f"({w.offered_rate:.2f}/s offered), prompts {w.mean_prompt_tokens:.0f} "
                  f"tokens, outputs {w.mean_output_tokens:.0f} tokens on average.", "",
                  routing_line(suite.routing), ""]
        lines += policy_table(suite) + [""]
        lines += ["| rate vs | measured |", "|---|---|",
                  f"| model-swap p99 TTFT | {_x(tg.p99_ttft_vs_model_swap, 1 / 3, True)} |",
                  f"| model-swap goodput | {_x(tg.goodput_vs_model_swap, 2.0, False)} |",
                  f"| all-resident throughput | "
                  f"{_x(tg.throughput_vs_all_resident, 0.8, False)} |", ""]
        lines += per_model_table(suite) + [""]
        lines += [f"![{p}]({p})" for p in plots if p.startswith(suite.name + "-")] + [""]
    return "\n".join(lines)


def plot_suite(suite: Suite, out: str) -> list[str]:
    """TTFT CDF per policy; resident expert bytes and request rate per model over time (one
    panel per policy). PNGs with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in suite.policies if p.error is None]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in ok:
        ttfts = np.sort([r.ttft_s for r in p.requests if r.ttft_s is not None])
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post",
                    label=p.policy)
    ax.set(xscale="log", xlabel="time to first token (s)", ylabel="share of requests",
           title=f"TTFT CDF ({suite.name} routing)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out, f"{suite.name}-ttft-cdf.png"))
    for key, label, scale in (("resident_bytes", "resident expert MiB", MiB),
                              ("request_rate", "request rate (req/s)", 1.0)):
        fig, axes = plt.subplots(len(ok), 1, figsize=(8, 2.2 * max(1, len(ok))), sharex=True,
                                 squeeze=False)
        for ax, p in zip(axes[:, 0], ok):
            t = [point.t_s for point in p.timeline]
            for model in suite.models:
                ax.plot(t, [getattr(point, key)[model] / scale for point in p.timeline],
                        label=model, linewidth=1)
            ax.set(ylabel=label if len(ok) == 1 else "", title=p.policy)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("seconds since the replay started")
        axes[0, 0].legend(fontsize=6, ncol=4, loc="upper right")
        fig.suptitle(f"{label} per model ({suite.name} routing)")
        paths.append(_save(fig, out, f"{suite.name}-{key.replace('_', '-')}.png"))
    return paths


def _save(fig, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
