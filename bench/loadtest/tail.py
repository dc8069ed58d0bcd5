"""What a `mox bench` run's requests waited on, from each server's per-step timeline
(`logs/<suite>-<policy>.steps.jsonl`):

- the slowest first tokens: each of a policy's N slowest TTFTs split into the time before its
  model's prompt step began (admission, a model-swap load, other models' steps), that step's
  wall time with what it stalled and parked on expert reads and the bytes it read, and what
  the other models stepped and read meanwhile;
- where decode time went: every request's time from its first token to its last, per output
  token, split into its own model's steps (computing, and blocked on reads), other models'
  steps (the engine runs one step at a time), and the rest (idle, or parked with nothing
  else to run).

    python -m mox.bench.loadtest.tail OUT [N]

Request times count from the replay's start, which results.json keeps on the machine's
monotonic clock (`origin_monotonic_s`), the clock the server's steps are logged on; runs
recorded before it was kept are skipped.
"""

from __future__ import annotations

import argparse
import os

import msgspec

from mox.bench.loadtest.results_schema import RequestRecord
from mox.bench.loadtest.two_runs import load
from mox.router.timeline import StepRecord, read_log

MiB = 2**20
SLACK_S = 0.05      # the two sides' timestamps: HTTP, tokenizing, the event loop


class TailRequest(msgspec.Struct):
    index: int
    model: str
    cold: bool
    ttft_s: float
    before_step_s: float        # sent -> its model's first prompt step began
    step_s: float               # that step's wall time ...
    stall_s: float              # ... blocked on its expert reads
    parked_s: float             # ... parked on them while other models stepped
    step_read_mib: float        # ... and the expert bytes it read
    others_steps: int           # other models' steps between sending and the first token
    others_s: float             # their wall time, less what they were parked
    others_read_mib: float      # expert bytes they read


def attribute(request: RequestRecord, steps: list[StepRecord], origin: float) -> TailRequest:
    """`origin`: the replay's start on the steps' clock."""
    sent = origin + request.sent_s
    first = sent + request.ttft_s
    # its prompt's step: the model's last prompt step that began after it was sent and ended
    # by its first token (a step that began just before it arrived did not take it)
    prompts = [s for s in steps if s.model == request.model and s.num_prefill_tokens > 0
               and s.start >= sent - SLACK_S and s.start + s.seconds <= first + SLACK_S]
    prompt = prompts[-1] if prompts else None
    others = [s for s in steps if s.model != request.model and sent <= s.start < first]
    step = prompt or StepRecord(first, request.model, 0, 0, 0, 0.0)
    return TailRequest(
        request.index, request.model, request.cold, request.ttft_s,
        max(0.0, step.start - sent), step.seconds, step.stall_seconds, step.parked_seconds,
        step.bytes_read / MiB, len(others), sum(s.seconds - s.parked_seconds for s in others),
        sum(s.bytes_read for s in others) / MiB)


def slowest(requests: list[RequestRecord], steps: list[StepRecord], origin: float, n: int
            ) -> list[TailRequest]:
    served = sorted((r for r in requests if r.ttft_s is not None), key=lambda r: -r.ttft_s)
    return [attribute(r, steps, origin) for r in served[:n]]


class DecodeShares(msgspec.Struct):
    """Milliseconds per output token after the first, summed over a policy's requests."""

    tpot_p50_ms: float
    own_ms: float               # its model's steps, less what they stalled or parked
    own_stall_ms: float         # its model's steps blocked on expert reads
    others_ms: float            # other models' steps, less what they parked
    rest_ms: float              # neither: idle, parked with nothing else to run, HTTP


def _overlap(step: StepRecord, start: float, end: float) -> float:
    """The share of `step` inside [start, end)."""
    if step.seconds <= 0:
        return 0.0
    inside = min(end, step.start + step.seconds) - max(start, step.start)
    return max(0.0, inside) / step.seconds


def decode_shares(requests: list[RequestRecord], steps: list[StepRecord], origin: float,
                  tpot_p50_s: float) -> DecodeShares:
    own = stall = others = window = 0.0
    tokens = 0
    for r in requests:
        if r.ttft_s is None or r.e2e_s is None or r.num_output_tokens < 2:
            continue
        start, end = origin + r.sent_s + r.ttft_s, origin + r.sent_s + r.e2e_s
        for step in steps:
            share = _overlap(step, start, end)
            if share == 0.0:
                continue
            running = share * (step.seconds - step.parked_seconds)
            if step.model == r.model:
                stall += share * step.stall_seconds
                own += running - share * step.stall_seconds
            else:
                others += running
        window += end - start
        tokens += r.num_output_tokens - 1
    per_token = 1e3 / max(1, tokens)
    return DecodeShares(1e3 * tpot_p50_s, own * per_token, stall * per_token,
                        others * per_token, (window - own - stall - others) * per_token)


def logged(out: str):
    """(suite, policy, its steps, its events) for every policy run with a step log and an
    origin."""
    for suite in load(out).suites:
        for policy in suite.policies:
            path = os.path.join(out, "logs", f"{suite.name}-{policy.policy}.steps.jsonl")
            if policy.error or policy.origin_monotonic_s is None or not os.path.exists(path):
                continue
            yield suite, policy, *read_log(path)


def decode_table(out: str) -> str:
    rows = ["| suite-policy | TPOT p50 ms | per output token: its model's steps ms (blocked on "
            "reads) | other models' steps ms | the rest ms |", "|---|---|---|---|---|"]
    for suite, policy, steps, _ in logged(out):
        d = decode_shares(policy.requests, steps, policy.origin_monotonic_s,
                          policy.latency.tpot.p50 or 0.0)
        rows.append(f"| {suite.name}-{policy.policy} | {d.tpot_p50_ms:.0f} | {d.own_ms:.0f} "
                    f"({d.own_stall_ms:.0f}) | {d.others_ms:.0f} | {d.rest_ms:.0f} |")
    return "\n".join(rows)


def ttft_table(out: str, n: int = 5) -> str:
    rows = ["| suite-policy | request (model, cold) | TTFT s | before its step s | its step s "
            "(stalled / parked) | its step read MiB | others' steps meanwhile (s, read MiB) |",
            "|---|---|---|---|---|---|---|"]
    for suite, policy, steps, _ in logged(out):
        for t in slowest(policy.requests, steps, policy.origin_monotonic_s, n):
            rows.append(
                f"| {suite.name}-{policy.policy} | #{t.index} ({t.model}, "
                f"{'cold' if t.cold else 'warm'}) | {t.ttft_s:.2f} | {t.before_step_s:.2f} | "
                f"{t.step_s:.2f} ({t.stall_s:.2f} / {t.parked_s:.2f}) | "
                f"{t.step_read_mib:.0f} | {t.others_steps} ({t.others_s:.2f} s, "
                f"{t.others_read_mib:.0f}) |")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT", help="a `mox bench --out` folder")
    parser.add_argument("slowest", nargs="?", type=int, default=5,
                        help="how many of each policy's slowest first tokens (default 5)")
    args = parser.parse_args()
    print(ttft_table(args.out, args.slowest))
    print()
    print(decode_table(args.out))
