"""Where a cold start's first token went, from each server's step log (steps and the router's
model events, mox.router.timeline): every request whose model's weights landed between its
sending and its first token waited on a load, and its TTFT splits into

- admission: sent -> its model's load began (0 if the load was already running: the model
  was loading, or a drained model's waiter came back in its next turn);
- load: the load (or the part of it after sending) -> the weights landed (model-swap: every
  expert; rate: the dense weights, its experts streaming into its first steps);
- queued: landed -> its prompt's step began (other models' steps, earlier prompts);
- step: its prompt's step, and what of it was parked on expert reads;

and the router's turns show as counts: loads, drains (a busy model's turn ended for a
waiter), parks by why.

    python -m mox.bench.loadtest.cold_starts OUT
"""

from __future__ import annotations

import argparse
import collections

import msgspec
import numpy as np

from mox.bench.loadtest.results_schema import RequestRecord
from mox.bench.loadtest.tail import attribute, logged
from mox.router.timeline import ModelEvent, StepRecord


class ColdStart(msgspec.Struct):
    index: int
    cold: bool                  # the client saw its model cold or loading when it arrived
    ttft_s: float
    admission_s: float
    load_s: float
    queued_s: float
    step_s: float
    parked_s: float


def cold_start(request: RequestRecord, steps: list[StepRecord], events: list[ModelEvent],
               origin: float) -> ColdStart | None:
    """The split of a request that waited on its model's load, or None if it did not."""
    if request.ttft_s is None:
        return None
    sent = origin + request.sent_s
    first = sent + request.ttft_s
    mine = [e for e in events if e.model == request.model]
    # the same clock on both sides: a model that landed before the request was sent was warm
    landed = next((e for e in mine if e.event == "landed" and sent <= e.start <= first), None)
    if landed is None:
        return None
    load = max((e.start for e in mine if e.event == "load" and e.start <= landed.start),
               default=sent)
    t = attribute(request, steps, origin)
    step_start = sent + t.before_step_s
    return ColdStart(request.index, request.cold, request.ttft_s, max(0.0, load - sent),
                     landed.start - max(load, sent), max(0.0, step_start - landed.start),
                     t.step_s, t.parked_s)


def _mean_p90(xs: list[float]) -> str:
    return f"{np.mean(xs):.2f} / {np.percentile(xs, 90):.2f}" if xs else "-"


def row(name: str, starts: list[ColdStart], events: list[ModelEvent]) -> str:
    col = lambda field: [getattr(c, field) for c in starts]
    kinds = collections.Counter(e.event for e in events)
    parks = collections.Counter(e.why for e in events if e.event == "park")
    parked = f"{np.mean(col('parked_s')):.2f}" if starts else "-"
    return (f"| {name} | {len(starts)} ({sum(col('cold'))}) | {_mean_p90(col('ttft_s'))} | "
            f"{_mean_p90(col('admission_s'))} | {_mean_p90(col('load_s'))} | "
            f"{_mean_p90(col('queued_s'))} | {_mean_p90(col('step_s'))} ({parked}) | "
            f"{kinds['load']} / {kinds['drain']} | "
            f"{', '.join(f'{n} {why}' for why, n in sorted(parks.items())) or '-'} |")


def table(out: str) -> str:
    rows = ["| suite-policy | waited on a load (client saw cold) | TTFT s mean / p90 | "
            "admission s | load s | queued s | its step s (parked) | loads / drains | "
            "parks (why) |", "|---|---|---|---|---|---|---|---|---|"]
    for suite, policy, steps, events in logged(out):
        if events:
            starts = [c for r in policy.requests
                      if (c := cold_start(r, steps, events, policy.origin_monotonic_s))]
            rows.append(row(f"{suite.name}-{policy.policy}", starts, events))
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT", help="a `mox bench --out` folder")
    print(table(parser.parse_args().out))
