"""Load-test report: results.json, the Markdown report (results.md) and the plots written
into the output directory. The schema is mox.bench.loadtest.results_schema; the figures come from
mox.bench.loadtest.summaries."""

from __future__ import annotations

import os

import msgspec
import numpy as np

from mox.bench.loadtest.cold_starts import table as cold_start_table
from mox.bench.loadtest.plots import MiB, plot_suite
from mox.bench.loadtest.results_schema import PolicyResult, Results, Suite, Target
from mox.bench.loadtest.routing_stats import RoutingStats
from mox.bench.loadtest.step_summary import table as step_table
from mox.bench.loadtest.tail import decode_table, ttft_table
from mox.router.timeline import replica_step_log

RESULTS_FILE, MARKDOWN_FILE = "results.json", "results.md"


def write_report(results: Results, out: str) -> list[str]:
    """results.json, results.md and the plots into `out`; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, RESULTS_FILE), os.path.join(out, MARKDOWN_FILE)]
    with open(paths[0], "wb") as f:
        f.write(msgspec.json.encode(results) + b"\n")
    plots = [p for suite in results.suites for p in plot_suite(suite, out)]
    # a fleet's replicas each write their own (mox.router.timeline.replica_step_log)
    names = [(f"{suite.name}-{policy.policy}", policy.replicas) for suite in results.suites
             for policy in suite.policies]
    steps = step_table(os.path.join(out, "logs"),
                       [replica_step_log(name, "*") if replicas else name
                        for name, replicas in names])
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(results, [os.path.basename(p) for p in plots]))
        if steps.count("\n") > 1:
            f.write("\n## Per-step timelines (logs/*.steps.jsonl)\n\n" + steps + "\n")
            f.write("\n## The slowest first tokens, split by the step timelines\n\n"
                    + ttft_table(out) + "\n")
            f.write("\n## Where decode time went, per output token\n\n"
                    + decode_table(out) + "\n")
            f.write("\n## Cold starts, split by the router's model events\n\n"
                    + cold_start_table(out) + "\n")
    return paths + plots


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def target_line(t: Target) -> str:
    """`| goodput vs model-swap | 1.62x | >= 1.50x | met |`"""
    ratio = "-" if t.ratio is None else f"{t.ratio:.2f}x"
    return f"| {t.figure} vs {t.baseline} | {ratio} | {t.condition} | {t.verdict} |"


def policy_table(suite: Suite) -> list[str]:
    rows = ["| policy | ok / sent | cold | TTFT p50 / p90 / p99 ms | cold TTFT p50 ms | "
            "TPOT p50 / p99 ms | e2e p99 ms | tok/s | goodput req/s | expert hit rate | "
            "read MiB (disk / host) | peak resident MiB | peak page cache MiB |",
            "|---" * 13 + "|"]
    for p in suite.policies:
        if p.error is not None:
            rows.append(f"| {p.policy} | error: {p.error[:120]} |" + " |" * 11)
            continue
        t, lat, pg = p.latency.ttft, p.latency, p.pager
        hit = "-" if pg.hit_rate is None else f"{pg.hit_rate:.2f}"
        rows.append(
            f"| {p.policy} | {p.counts.ok} / {p.counts.requests} | {p.counts.cold} | "
            f"{_ms(t.p50)} / {_ms(t.p90)} / {_ms(t.p99)} | {_ms(lat.cold_ttft.p50)} | "
            f"{_ms(lat.tpot.p50)} / {_ms(lat.tpot.p99)} | {_ms(lat.e2e.p99)} | "
            f"{p.throughput_tokens_per_s:.1f} | {p.goodput_requests_per_s:.2f} | {hit} | "
            f"{pg.bytes_read / MiB:.0f} ({pg.bytes_read_disk / MiB:.0f} / "
            f"{pg.bytes_read_host / MiB:.0f}) | {pg.peak_resident_bytes / MiB:.0f} | "
            f"{p.peak_page_cache_bytes / MiB:.0f} |")
    return rows


def prefetch_line(suite: Suite) -> str:
    """How well the predictions that loaded experts ahead of use did, per policy."""
    cells = [f"{p.policy} {p.pager.prefetch_hits}/{p.pager.prefetches}"
             for p in suite.policies if p.error is None and p.pager.prefetches]
    line = ("Prefetch (predicted experts used / loaded): " + ", ".join(cells) if cells
            else "Prefetch: none (off on a CPU by default).")
    preloads = [f"{p.policy} {p.pager.preloads}" for p in suite.policies
                if p.error is None and p.pager.preloads]
    return line + (" Preloaded with cold starts (experts): " + ", ".join(preloads) + "."
                   if preloads else "")


def send_lag_line(suite: Suite) -> str:
    """How far the client's sends fell behind the arrival schedule (TTFT counts from the
    send, so a lagging client would hide that much of a policy's queueing)."""
    cells = []
    for p in suite.policies:
        # (one not sent, or cut at the deadline, carries its arrival as its send)
        lags = [r.sent_s - r.arrival_s for r in p.requests
                if not (r.error or "").startswith(("not sent", "not finished"))]
        if p.error is None and lags:
            cells.append(f"{p.policy} {1e3 * float(np.percentile(lags, 99)):.0f}")
    return ("Sends behind the arrival schedule, p99 ms (TTFT counts from the send): "
            + ", ".join(cells) + ".") if cells else ""


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


def _one_process_warm(suite: Suite) -> str:
    """The share of `rate`'s requests (one process, the whole budget) that found their model
    warm, for comparison with a Ray run's."""
    rate = next((p for p in suite.policies if p.policy == "rate" and p.latency), None)
    if rate is None:
        return ""
    warm, cold = rate.latency.warm_ttft.count, rate.latency.cold_ttft.count
    return (f" In one process (rate, the whole budget) {warm / (warm + cold):.0%} found their "
            f"model warm{_past_first_touches(rate, warm)}." if warm + cold else "")


def _past_first_touches(p: PolicyResult, warm: int) -> str:
    """`warm` of p's requests found their model warm: as a share of those sent after their
    model's first token (the others could find it warm nowhere, though one sent after its
    dense weights landed may have: the share is capped at 1)."""
    first, sent = p.first_touches, len(p.requests)
    if not first or sent <= first:
        return ""
    return (f" ({min(warm, sent - first) / (sent - first):.0%} of the {sent - first} sent "
            "after their model's first token)")


def fleet_table(suite: Suite) -> list[str]:
    """Per replica of each Ray run: the requests that landed there per model (warm / all) and
    each model's warmth there at the end."""
    lines = []
    for p in suite.policies:
        if not p.replicas:
            continue
        warm, held, routed = (f"{s:.0%}" if s is not None else "-"
                              for s in (p.warm_share, p.held_share, p.routed_warm_share))
        landed_warm = sum(n for r in p.replicas for n in r.landed_warm.values())
        lines += [f"{p.policy}: {warm} of requests landed on a replica where their model was "
                  f"warm (dense weights on){_past_first_touches(p, landed_warm)}, {held} on "
                  "one that held it (in its multiplexed set; the budget may have parked it "
                  f"there). {p.first_touches} were sent before any request of their model had "
                  "its first token: no replica had it warm for them. Of the requests whose "
                  "model was warm on some replica (by the replicas' reports, up to two seconds "
                  f"old), {routed} landed where it was warm; the others' models were warm "
                  "nowhere."
                  + _one_process_warm(suite), "",
                  "| replica | requests landed (warm / held / all) per model | warmth at the end |",
                  "|---|---|---|"]
        for r in p.replicas:
            landed = ", ".join(f"{m} {r.landed_warm.get(m, 0)}/{r.landed_held.get(m, 0)}/{n}"
                               for m, n in sorted(r.landed.items()))
            warmth = ", ".join(f"{m} {w:.2f}" for m, w in sorted(r.warmth.items()) if w)
            lines.append(f"| {r.replica} | {landed or '-'} | {warmth or '-'} |")
        lines.append("")
    return lines


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
             + f"; device budget = dense + {c.device_memory_fraction:g} x experts"
             + (f" (bf16 experts; served {c.quantize})" if c.quantize else "")
             + (" (served expert-major)" if c.expert_major else "") + "; "
             f"SLO TTFT {c.slo.ttft_ms:g} ms, TPOT {c.slo.tpot_ms:g} ms"
             + ("; every server keeps the SLO's TPOT as its target (--tpot-target)"
                if c.tpot_target else "") + ".", ""]
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
        lines += [prefetch_line(suite), "", send_lag_line(suite), ""]
        lines += ["| rate: figure vs baseline | ratio | target | |", "|---|---|---|---|",
                  *map(target_line, tg), ""]
        lines += per_model_table(suite) + [""]
        lines += fleet_table(suite)
        lines += [f"![{p}]({p})" for p in plots if p.startswith(suite.name + "-")] + [""]
    return "\n".join(lines)
