"""What a server's per-step timeline (`mox serve --step-log`) says about where its time went:
decode and prefill steps (wall and CPU ms), seconds stalled on expert reads (blocking the
engine) and parked on them (while other models stepped), misses and bytes read inside steps,
and how many models shared the engine. `mox bench` writes one log per suite
and policy (`logs/<suite>-<policy>.steps.jsonl`);

    python -m mox.bench.loadtest.step_summary OUT/logs

prints a table of them, the evidence behind a gap in the load test's targets.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence

import msgspec
import numpy as np

from mox.router.timeline import StepRecord, read_log

MiB = 2**20


class StepSummary(msgspec.Struct):
    steps: int
    span_s: float                   # first step's start to last step's end
    busy_s: float                   # sum of step durations, less their parked time
    decode_ms_p50: float
    decode_ms_mean: float
    decode_cpu_ms_mean: float       # the engine thread's CPU time (the rest: waits, preemption)
    decode_seqs_mean: float
    decode_missing: int             # decode steps that missed
    decode_below_run: int           # decode steps of a model below its run size (planner)
    prefill_steps: int
    prefill_ms_mean: float
    stall_s: float                  # blocked on expert reads inside steps
    parked_s: float                 # parked on expert reads while other models stepped
    misses: int
    read_mib: float                 # expert bytes read inside steps (loads on the loader
                                    # thread, like model-swap's, are not steps)
    models_per_10s: float           # distinct models stepped in a 10 s window, on average


def summarize(records: list[StepRecord]) -> StepSummary:
    decode = [r for r in records if r.num_prefill_tokens == 0]
    prefill = [r for r in records if r.num_prefill_tokens > 0]
    start = records[0].start
    windows: dict[int, set[str]] = {}
    for r in records:
        windows.setdefault(int((r.start - start) // 10), set()).add(r.model)
    ms = lambda rs, field: [1e3 * getattr(r, field) for r in rs]
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0
    return StepSummary(
        len(records), records[-1].start + records[-1].seconds - start,
        sum(r.seconds - r.parked_seconds for r in records),
        float(np.median(ms(decode, "seconds"))) if decode else 0.0,
        mean(ms(decode, "seconds")), mean(ms(decode, "cpu_seconds")),
        mean([r.num_seqs for r in decode]), sum(r.misses > 0 for r in decode),
        sum(0 < r.slots < r.run_slots for r in decode), len(prefill), mean(ms(prefill, "seconds")),
        sum(r.stall_seconds for r in records), sum(r.parked_seconds for r in records),
        sum(r.misses for r in records),
        sum(r.bytes_read for r in records) / MiB, mean([len(m) for m in windows.values()]))


def table(logs_dir: str, names: Sequence[str] = ("*",)) -> str:
    """One row per step log `logs_dir/<name>.steps.jsonl` of `names` (glob patterns: a
    report's are its run's suites and policies, as an earlier run into the same folder may
    have left others)."""
    rows = ["| log | steps | busy / span s | decode ms p50 / mean (CPU) | seqs per decode | "
            "decodes missing / below run size | prefills (mean ms) | stalled / parked s | "
            "misses | read in steps MiB | models per 10 s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in [p for name in names
                 for p in sorted(glob.glob(os.path.join(logs_dir, f"{name}.steps.jsonl")))]:
        records, _ = read_log(path)
        if not records:
            continue
        s = summarize(records)
        rows.append(f"| {os.path.basename(path).removesuffix('.steps.jsonl')} | {s.steps} | "
                    f"{s.busy_s:.0f} / {s.span_s:.0f} | {s.decode_ms_p50:.0f} / "
                    f"{s.decode_ms_mean:.0f} ({s.decode_cpu_ms_mean:.0f}) | "
                    f"{s.decode_seqs_mean:.2f} | {s.decode_missing} / {s.decode_below_run} | "
                    f"{s.prefill_steps} ({s.prefill_ms_mean:.0f}) | "
                    f"{s.stall_s:.1f} / {s.parked_s:.1f} | {s.misses} | {s.read_mib:.0f} | "
                    f"{s.models_per_10s:.1f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(sys.argv[1] if len(sys.argv) > 1 else "."))
