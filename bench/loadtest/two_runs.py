"""Two `mox bench` runs of the same command side by side: every figure as "run 1 / run 2", the
way the README reports the load test (the machine is shared and noisy, so one run is not a
measurement). Latencies are over the requests that succeeded: "ok/sent" says how many.

    python -m mox.bench.loadtest.two_runs OUT1 OUT2
"""

from __future__ import annotations

import argparse
import os

import msgspec

from mox.bench.loadtest.results_schema import PolicyResult, Results, Suite

GiB = 2**30

# (header, figure of a policy's result (None: none measured), format)
COLUMNS = (
    ("ok/sent", lambda p: f"{p.counts.ok}/{p.counts.requests}", "{}"),
    ("TTFT p50 s", lambda p: p.latency.ttft.p50, "{:.2f}"),
    ("TTFT p99 s", lambda p: p.latency.ttft.p99, "{:.1f}"),
    ("TPOT p50 ms", lambda p: _ms(p.latency.tpot.p50), "{:.0f}"),
    ("TPOT p99 ms", lambda p: _ms(p.latency.tpot.p99), "{:.0f}"),
    ("goodput req/s", lambda p: p.goodput_requests_per_s, "{:.2f}"),
    ("tok/s", lambda p: p.throughput_tokens_per_s, "{:.1f}"),
    ("read GiB", lambda p: p.pager.bytes_read / GiB, "{:.1f}"),
)


def load(out: str) -> Results:
    with open(os.path.join(out, "results.json"), "rb") as f:
        return msgspec.json.decode(f.read(), type=Results)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _cell(results: list[PolicyResult | None], figure, fmt: str) -> str:
    values = [None if p is None or p.error else figure(p) for p in results]
    return " / ".join("-" if v is None else fmt.format(v) for v in values)


def policy_table(suites: list[Suite]) -> list[str]:
    names = [p.policy for p in suites[0].policies]
    rows = ["| policy | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
            "|---|" + "---|" * len(COLUMNS)]
    for name in names:
        runs = [next((p for p in s.policies if p.policy == name), None) for s in suites]
        if all(p is None or p.error for p in runs):
            rows.append(f"| {name} | " + " | ".join("-" for _ in COLUMNS) + " |")
            continue
        rows.append(f"| {name} | " + " | ".join(_cell(runs, f, fmt) for _, f, fmt in COLUMNS)
                    + " |")
    return rows


def target_table(suites: list[Suite]) -> list[str]:
    runs_named = " (run 1 / run 2)" if len(suites) > 1 else ""
    rows = [f"| rate: figure vs baseline | target | ratio{runs_named} | met |",
            "|---|---|---|---|"]
    for i, target in enumerate(suites[0].targets):
        runs = [s.targets[i] for s in suites]
        ratios = " / ".join("-" if t.ratio is None else f"{t.ratio:.2f}x" for t in runs)
        met = " / ".join(t.verdict for t in runs)
        rows.append(f"| {target.figure} vs {target.baseline} | {target.condition} | {ratios} | "
                    f"{met} |")
    return rows


def compare(outs: list[str]) -> str:
    """Suites matched by name: a suite some runs lack is shown over the runs that have it."""
    runs = [load(out) for out in outs]
    names = list(dict.fromkeys(s.name for r in runs for s in r.suites))
    lines = []
    for name in names:
        suites = [s for r in runs for s in r.suites if s.name == name]
        errors = sorted({p.error for s in suites for p in s.policies if p.error})
        count = "" if len(suites) == len(runs) else f", {len(suites)} of the {len(runs)} runs"
        lines += [f"### {name} routing ({suites[0].workload.num_requests} requests a run{count})",
                  "", *policy_table(suites), "", *target_table(suites), ""]
        lines += [f"Not run: {e}" for e in errors] + ([""] if errors else [])
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outs", nargs="+", metavar="OUT", help="a `mox bench --out` folder")
    print(compare(parser.parse_args().outs))
