"""What each step did, and a watchdog for steps that take too long.

Every router step that runs a batch leaves a `StepRecord`: when it started, which model
stepped, how many sequences and tokens (prefill and decode), how long it took, and what it
waited on in the pager (seconds stalled on expert reads, misses, waves, bytes read), and how
long it was parked on its reads while other models stepped (mox.engine.in_flight). Between
the steps, a `ModelEvent` marks each change of a model's residency: a load starts (admitted),
its weights land, a busy model is drained (its turn ends), a model is parked (and why). A cold
request's first token is then its wait for admission, its model's load, and its steps. The
last `TIMELINE_LENGTH` records and events stay in memory (`Router.timeline.records`,
`.events`), and `mox serve --step-log FILE` appends each as a JSON line (a write error logs
once and stops the log); `read_log` reads such a file back.

The `Watchdog` thread looks at the step in progress once a second; a step running longer than
`threshold_s` is logged (WARNING) with its model, batch, and what the model's pool is waiting
on at that moment (reads in flight or a free slot), again each time its duration doubles.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import msgspec

log = logging.getLogger("mox.steps")

# Records kept in memory: a few minutes of steps at tens of steps a second.
TIMELINE_LENGTH = 4096
# A step running this long is reported: healthy steps take tens to hundreds of ms, and a cold
# model's first prefill (reading its routed experts) about a second on this class of machine.
WATCHDOG_THRESHOLD_S = 5.0
WATCHDOG_PERIOD_S = 1.0
# Decode costs weigh a step this much less each newer step: about the last 200 steps, a few
# seconds of a busy server, so they follow the load.
COST_DECAY = 0.995


class StepRecord(msgspec.Struct, omit_defaults=True, gc=False):
    start: float                    # time.monotonic() when the step began
    model: str
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int         # tokens of sequences still in their prompt
    seconds: float
    cpu_seconds: float = 0.0        # the engine thread's CPU time: far below `seconds` when
                                    # it was descheduled (other processes, a noisy host)
    stall_seconds: float = 0.0      # waiting for expert reads to land
    misses: int = 0
    waves: int = 0
    bytes_read: int = 0
    num_waiting_models: int = 0     # other models with requests while this one stepped
    parked_seconds: float = 0.0     # of `seconds`, parked on its reads while others stepped
    slots: int = 0                  # the model's expert slots when the step ended
    run_slots: int = 0              # its run size this turn (mox.router.views; 0: unknown)
    capture_seconds: float = 0.0    # of `seconds`, capturing decode graphs (GPU)


class ModelEvent(msgspec.Struct, omit_defaults=True, gc=False):
    event: str                      # load | landed | failed | drain | park (first: the log's
                                    # readers tell events from steps by it)
    start: float                    # time.monotonic(), the steps' clock
    model: str
    preload: int = 0                # load: experts read with the dense weights
    stream: bool = False            # load: it runs before the preload has landed
    why: str = ""                   # park: idle, drained, room (for another model), closed


@dataclass
class DecodeCosts:
    """What recent decode steps cost (sums decayed by `COST_DECAY` a step): a token's own time
    (the step less its waits on expert reads), and what a miss added to its step (stalled on
    the read, or parked while other models stepped). The planner's run sizes weigh one against
    the other (mox.router.planner.run_extra_misses)."""

    token_s: float = 0.0
    tokens: float = 0.0
    miss_s: float = 0.0
    misses: float = 0.0

    def add(self, r: StepRecord) -> None:
        if r.num_prefill_tokens:
            return
        waited = r.stall_seconds + r.parked_seconds
        self.token_s = COST_DECAY * self.token_s + max(0.0, r.seconds - waited)
        self.tokens = COST_DECAY * self.tokens + r.num_tokens
        if r.misses:
            self.miss_s = COST_DECAY * self.miss_s + waited
            self.misses = COST_DECAY * self.misses + r.misses

    @property
    def seconds_per_token(self) -> float | None:
        return self.token_s / self.tokens if self.tokens >= 1 else None

    @property
    def seconds_per_miss(self) -> float | None:
        return self.miss_s / self.misses if self.misses >= 1 else None


class Timeline:
    def __init__(self, sink: IO[str] | None = None, length: int = TIMELINE_LENGTH) -> None:
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=length)
        self.events: collections.deque[ModelEvent] = collections.deque(maxlen=length)
        self.costs = DecodeCosts()
        self._sink = sink
        self._encoder = msgspec.json.Encoder()

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        self.costs.add(record)
        self._write(record)

    def event(self, event: ModelEvent) -> None:
        self.events.append(event)
        self._write(event)

    def _write(self, item: StepRecord | ModelEvent) -> None:
        if self._sink is None:
            return
        try:
            self._sink.write(self._encoder.encode(item).decode() + "\n")
            self._sink.flush()
        except OSError as e:                  # a full disk must not stop serving
            log.error("step log stopped: %s", e)
            self._sink = None

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()


def replica_step_log(path: str, replica: str) -> str:
    """`run.steps.jsonl` -> `run-<replica>.steps.jsonl`: one timeline per engine of a fleet
    (the replica goes before the file name's first dot; "*" gives the glob of them all)."""
    folder, name = os.path.split(path)
    stem, dot, rest = name.partition(".")
    return os.path.join(folder, f"{stem}-{replica}{dot}{rest}")


def read_log(path: str) -> tuple[list[StepRecord], list[ModelEvent]]:
    """The steps and the events of a step log (`mox serve --step-log`), each in order."""
    steps, events = msgspec.json.Decoder(StepRecord), msgspec.json.Decoder(ModelEvent)
    records, changes = [], []
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b'{"event"'):
                changes.append(events.decode(line))
            elif line.strip():
                records.append(steps.decode(line))
    return records, changes


class Watchdog:
    """`current()` returns (seconds the step in progress has run, what it is doing), or None
    between steps; it is called from the watchdog's thread and must be safe there."""

    def __init__(self, current: Callable[[], tuple[float, str] | None],
                 threshold_s: float = WATCHDOG_THRESHOLD_S,
                 period_s: float = WATCHDOG_PERIOD_S) -> None:
        self.current, self.threshold_s, self.period_s = current, threshold_s, period_s
        self.reports = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mox-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_report = self.threshold_s
        while not self._stop.wait(self.period_s):
            state = self.current()
            if state is None or state[0] < self.threshold_s:
                next_report = self.threshold_s
                continue
            elapsed, doing = state
            if elapsed >= next_report:
                self.reports += 1
                log.warning("step running for %.1f s: %s", elapsed, doing)
                next_report = 2 * elapsed

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
