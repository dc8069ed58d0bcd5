"""A step in flight: one batch's forward pass, run in slices, which parks where a MoE layer
waits for expert reads (mox.pager.pending) while the engine steps other models.

Design note.
- The runner's `steps(batch)` is a generator: it yields None at each layer boundary (a CPU
  decode step whose layers run in native calls, mox/models/decoder.py's `_decode_layers`,
  yields after each call: once, at its end, when every expert it routes to is resident; once
  for several decode steps run back to back) and a `ReadsPending` where a layer's routed
  experts are still being read, and returns the sampled tokens at its end, a list per step.
  The engine gives each slice to the oldest step in flight that can go on, so a step parked
  on reads resumes within a slice of their landing; only when every step in
  flight waits for reads does another model's batch start (the scheduler skips a model with a
  step in flight), and with nothing else to run the oldest resumes at once and blocks on its
  reads (as every step did before).
- Nothing a parked step holds can change under it: its sequences' KV blocks were reserved
  before it started and another model's scheduling never preempts them; the experts it
  computed are released and the ones it waits for are reserved by their loads. A request
  aborted while its step is in flight ends at once, but its KV blocks are freed when the step
  ends (the step still writes them) and its sampled token is dropped; a step left with no live
  request is dropped (`close`; it has not advanced its sequences).
- Its figures for the timeline: seconds from start to end (parked time included and also
  counted apart), the CPU seconds of its own slices, and its model's pager counters over its
  life (other models' steps do not touch them).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from mox.engine.runner import SampledToken
from mox.engine.scheduler import Batch
from mox.engine.sequence import Sequence
from mox.pager import ModelPool, ReadsPending


@dataclass(frozen=True)
class StepInfo:
    """The batch a step runs, and when finished what it took: for the router's timeline and
    its watchdog."""

    model: str
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int        # tokens of sequences still in their prompt
    started: float                 # time.monotonic()
    seconds: float = 0.0           # start to end, parked time included
    cpu_seconds: float = 0.0       # the stepping thread's CPU time in this step's slices
    parked_seconds: float = 0.0    # parked while other models stepped
    stall_seconds: float = 0.0     # blocked on its expert reads
    misses: int = 0
    waves: int = 0
    bytes_read: int = 0
    capture_seconds: float = 0.0   # capturing the model's decode graphs (GPU)


@dataclass
class InFlight:
    batch: Batch
    steps: Generator[ReadsPending | None, None, list[list[SampledToken]]]
    info: StepInfo
    pool: ModelPool
    pager_before: tuple[float, int, int, int, float] = field(init=False)
    pending: ReadsPending | None = None
    aborted: list[Sequence] = field(default_factory=list)   # ended; KV freed when it ends
    cpu_seconds: float = 0.0
    parked_at: float | None = None
    parked_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.pager_before = self.pool.step_figures()

    @property
    def sequences(self) -> list[Sequence]:
        return [item.seq for item in self.batch.sequences]

    @property
    def resumable(self) -> bool:
        """Can it go on without waiting (not started, at a layer boundary, or its reads
        landed)?"""
        return self.pending is None or self.pending.done

    def advance(self) -> list[list[SampledToken]] | None:
        """One slice: run until the batch ends (its sampled tokens, a list per step) or
        yields at a layer boundary or where it waits for reads (None)."""
        now, cpu = time.monotonic(), time.thread_time()
        if self.parked_at is not None:
            self.parked_seconds += now - self.parked_at
            self.parked_at = None
        try:
            self.pending = next(self.steps)
            self.parked_at = time.monotonic()
            return None
        except StopIteration as finished:
            self.pending = None
            return finished.value
        finally:
            self.cpu_seconds += time.thread_time() - cpu

    def finished_info(self, num_steps: int = 1) -> StepInfo:
        """The step's info with what it took (call once it ended, or failed), its tokens
        those of all `num_steps` decode steps it ran."""
        stall, misses, waves, nbytes, capture = (
            now - then for now, then in zip(self.pool.step_figures(), self.pager_before))
        return replace(self.info, num_tokens=self.info.num_tokens * num_steps,
                       seconds=time.monotonic() - self.info.started,
                       cpu_seconds=self.cpu_seconds, parked_seconds=self.parked_seconds,
                       stall_seconds=stall, misses=misses, waves=waves, bytes_read=nbytes,
                       capture_seconds=capture)

    def close(self) -> None:
        """Drop the step (it has not advanced its sequences; its leases end)."""
        self.steps.close()
