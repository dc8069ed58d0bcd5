"""The scheduler: which model runs next, and which of its sequences, with how many tokens.

Design note.
- Token-level switching: each step runs one batch of one model. The model whose queue has
  waited longest since it last ran goes next (round robin among models with work, so none
  starves and a cold model's first request is served between the hot models' steps). A model
  with a step in flight (run in slices, parked where its expert reads have not landed:
  mox.engine.in_flight) is not scheduled again until that step ends, and its running
  sequences are never preempted meanwhile; so a cold model streaming its experts in computes
  layer by layer as they land while other models step. A draining model (`set_draining`: the router
  wants its memory for a model that has waited) finishes its running sequences and starts no
  new ones.
- The round (opt-in, `tpot_target_s`): a running sequence gets one token per round of the
  models that run, so every model that joins slows the others' time per output token. A
  model with no running sequences joins only while the round of the models running then,
  it included, stays within the target (each model's share: its recent own step time); the
  one with the oldest request joins first, and while it waits no running model starts a
  request newer than that one, so the round empties enough for it to join. Under overload
  this serves fewer models at a time at the target's speed instead of every model too slowly
  for any client's TPOT objective (the model-swap baseline gets the same effect from its
  slow loads; bench/results/harness-16-avx2-0.4-*).
- Within a model: running sequences first (decodes, and prefills still in progress), then
  waiting ones in arrival order, until the step's token budget or sequence cap is reached.
  A long prompt is prefilled in chunks of at most the token budget, so it cannot stall the
  decodes that share its steps.
- Multi-step decode (`decode_steps` > 1): a batch of decodes alone in the engine (no prompt
  in it, no request waiting, no other model with work) runs several steps back to back, each
  step's tokens fed to the next without a return to the engine (mox.engine.runner), so the
  Python of a step (scheduling, building the index tensors, sampling, the outputs) is paid
  once for several tokens. Its KV blocks are reserved for every step before it starts; the
  steps stop early where a sequence samples a stop token, and never run past a sequence's
  `max_tokens`. A run lasts about `decode_run_s` at most (the model's recent decode steps'
  time decides how many steps that is), since its tokens stream out when it ends; and it ends
  after any step where the engine's `interrupt` says that something waits (a request that
  arrived, an abort, weights that landed), so that waits one step, not the whole run.
- KV: a sequence gets the blocks its new tokens need before it is scheduled. When the pool is
  full, the newest running sequence (of any model) is preempted: its blocks are freed and it
  waits to be recomputed. A sequence that cannot fit even alone fails instead of looping.
  After a preemption, until some sequence ends, a waiting one starts only if the free KV
  holds it to its `max_tokens` (or nothing else runs): let back in as soon as its next chunk
  fits, a preempted sequence recomputed its context only to be preempted again when the
  pool refilled, and two long streams that could not both fit crawled for tens of seconds
  recomputing each other's victim instead of running one after the other.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from mox.engine.kv_pool import KVPool
from mox.engine.sequence import Sequence, SequenceStatus

# A model's share of the round follows its last few steps (batch sizes change as requests
# come and go; one slow step, e.g. a miss, should not hold a model back for long).
STEP_EWMA = 0.3
# About how long a run of decode steps may last (its tokens stream out when it ends): a few
# updates a second for a reader, and four steps of the bench olmoe at 32 sequences on 2 cores
# (0.1 s gave runs of two there, and 1.4x the Python a step: bench/results/step_ab-long-runs).
DEFAULT_DECODE_RUN_S = 0.2


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 256     # tokens per step: bounds a prefill chunk's latency
    max_running_sequences: int = 64
    tpot_target_s: float | None = None   # the round's target (None: every model runs)
    decode_steps: int = 1             # most decode steps a batch runs back to back (above)
    decode_run_s: float | None = DEFAULT_DECODE_RUN_S   # and about how long such a run may
                                      # last (above; None: no limit)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int               # tokens of this sequence computed in this step

    @property
    def samples(self) -> bool:
        """Does this step reach the sequence's last token (so a new token is sampled)?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class Batch:
    model: str
    sequences: list[ScheduledSequence]
    num_steps: int = 1                # decode steps it may run back to back (KV reserved)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)


@dataclass
class _ModelQueue:
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    last_run: float = 0.0
    ready: bool = False               # weights loaded: the model can run
    draining: bool = False            # finishes its running sequences, starts no new one
    in_flight: bool = False           # a step of it is under way (run in slices): not again
    step_s: float = 0.0               # its share of a round: its recent steps' own time
    decode_step_s: float = 0.0        # ... of its recent steps of decodes alone (run lengths)

    @property
    def oldest_waiting(self) -> float:
        return min((s.arrival_time for s in self.waiting), default=math.inf)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def runnable(self) -> bool:
        return (self.ready and not self.in_flight
                and bool(self.running or (self.waiting and not self.draining)))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_pool: KVPool) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.queues: dict[str, _ModelQueue] = {}
        self._in_step: set[int] = set()       # ids of the sequences scheduled this step
        # sequences that cannot grow even with every other sequence preempted: the KV pool is
        # their context limit, so the engine finishes them (reason "length")
        self.out_of_kv: list[Sequence] = []
        self._preempted_since_an_end = False      # (the design note's KV paragraph)

    def add_model(self, name: str) -> None:
        self.queues[name] = _ModelQueue()

    def add(self, seq: Sequence) -> None:
        self.queues[seq.model].waiting.append(seq)

    def set_ready(self, name: str, ready: bool) -> None:
        self.queues[name].ready = ready

    def set_draining(self, name: str, draining: bool) -> None:
        self.queues[name].draining = draining

    def set_in_flight(self, name: str, in_flight: bool) -> None:
        self.queues[name].in_flight = in_flight

    def record_step(self, name: str, seconds: float, decodes_only: bool = False) -> None:
        """A step of `name` took the loop `seconds` (its own slices and stalls, not the time
        it was parked while others stepped); `decodes_only`: it had no prompt tokens (a
        prefill's time would cut the next runs of decode steps short)."""
        queue = self.queues.get(name)
        if queue is not None:
            queue.step_s = _ewma(queue.step_s, seconds)
            if decodes_only:
                queue.decode_step_s = _ewma(queue.decode_step_s, seconds)

    def _held_back(self) -> tuple[set[str], float]:
        """(models that may not join the round now, the oldest arrival among their
        requests: no running model starts a newer one)."""
        target = self.config.tpot_target_s
        if target is None:
            return set(), math.inf
        joining = sorted((q.oldest_waiting, name) for name, q in self.queues.items()
                         if q.runnable and not q.running)
        round_s = sum(q.step_s for q in self.queues.values() if q.running)
        in_round = any(q.running for q in self.queues.values())
        for i, (_, name) in enumerate(joining):
            step_s = self.queues[name].step_s
            if in_round and round_s + step_s > target:
                held = joining[i:]
                return {n for _, n in held}, held[0][0]
            round_s, in_round = round_s + step_s, True
        return set(), math.inf

    @property
    def has_work(self) -> bool:
        """Work that can run now (of a model whose weights are loaded)."""
        return any(q.runnable for q in self.queues.values())

    def schedule(self) -> Batch | None:
        held, before = self._held_back()
        candidates = [(q.last_run, name) for name, q in self.queues.items()
                      if q.runnable and name not in held]
        if not candidates:
            return None
        _, model = min(candidates)
        queue = self.queues[model]
        queue.last_run = time.monotonic()
        budget = self.config.max_batched_tokens
        scheduled: list[ScheduledSequence] = []
        self._in_step = set()
        for seq in list(queue.running):
            if seq.status != SequenceStatus.RUNNING:     # preempted by an earlier allocation
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            if self._reserve(seq, num_new):
                scheduled.append(ScheduledSequence(seq, num_new))
                self._in_step.add(id(seq))
                budget -= num_new
            elif (self._newest_running(exclude=seq) is None and not scheduled
                  and not self._held_in_flight()):
                self.release(seq)
                self.out_of_kv.append(seq)
            else:
                self.preempt(seq)
        max_running = self.config.max_running_sequences
        while (queue.waiting and not queue.draining and budget > 0
               and len(queue.running) < max_running
               and queue.waiting[0].arrival_time <= before):
            seq = queue.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._preempted_since_an_end and not self._fits_to_end(seq):
                break
            if not self._reserve(seq, num_new, may_preempt=False):
                break
            queue.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            queue.running.append(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        assert budget >= 0 and all(s.num_new_tokens > 0 for s in scheduled)
        if not scheduled:
            return None
        return Batch(model, scheduled, self._decode_steps(model, scheduled))

    def _decode_steps(self, model: str, scheduled: list[ScheduledSequence]) -> int:
        """How many decode steps the batch may run back to back: one unless it is all
        decodes and nothing else waits for the engine; at most what every sequence may still
        generate, what fits `decode_run_s` at the model's recent decode steps' time, and
        what the KV pool holds without preempting anyone."""
        step_s, run_s = self.queues[model].decode_step_s, self.config.decode_run_s
        in_time = (self.config.decode_steps if step_s == 0.0 or run_s is None
                   else max(1, int(run_s / step_s)))
        steps = min([self.config.decode_steps, in_time]
                    + [s.seq.params.max_tokens - s.seq.num_output_tokens for s in scheduled])
        if (steps <= 1 or any(s.num_new_tokens != 1 or not s.samples for s in scheduled)
                or any(q.waiting or (q.running and name != model)
                       for name, q in self.queues.items())):
            return 1
        if all(self._reserve(s.seq, steps, may_preempt=False) for s in scheduled):
            return steps
        return 1               # (the blocks it did get serve the sequences' next steps)

    def _reserve(self, seq: Sequence, num_new: int, may_preempt: bool = True) -> bool:
        """Blocks for `num_new` more tokens of `seq`, preempting newer sequences if need be."""
        needed = (self.kv_pool.blocks_needed(seq.num_computed_tokens + num_new)
                  - len(seq.block_table))
        while needed > 0:
            blocks = self.kv_pool.allocate(seq.model, needed)
            if blocks is not None:
                seq.block_table += blocks
                return True
            victim = self._newest_running(exclude=seq) if may_preempt else None
            if victim is None or victim.arrival_time < seq.arrival_time:
                return False                 # only older work holds the pool: seq yields
            self.preempt(victim)
        return True

    def _fits_to_end(self, seq: Sequence) -> bool:
        """Could `seq` run to its `max_tokens` in the free KV (or is nothing else running)?"""
        if not any(q.running for q in self.queues.values()):
            return True
        tokens = seq.num_tokens + seq.params.max_tokens - seq.num_output_tokens
        return self.kv_pool.can_allocate(
            seq.model, self.kv_pool.blocks_needed(tokens) - len(seq.block_table))

    def _newest_running(self, exclude: Sequence) -> Sequence | None:
        """The preemption victim: newest running sequence not already in this step, nor in
        a step in flight (whose KV it is writing)."""
        running = [s for q in self.queues.values() if not q.in_flight for s in q.running
                   if s is not exclude and id(s) not in self._in_step]
        return max(running, key=lambda s: s.arrival_time, default=None)

    def _held_in_flight(self) -> bool:
        """Do steps in flight hold KV (which they free when they end, or become
        preemptable)? Then a sequence that cannot grow waits instead of ending."""
        return any(q.in_flight and q.running for q in self.queues.values())

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's KV and put it back at the head of its queue (recompute)."""
        self.release(seq)
        self._preempted_since_an_end = True
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.queues[seq.model].waiting.appendleft(seq)

    def release(self, seq: Sequence, free_kv: bool = True) -> None:
        """Drop the sequence from its queue and return its blocks (`free_kv`; else its
        owner frees them later: a step in flight still writes them)."""
        self._preempted_since_an_end = False
        queue = self.queues[seq.model]
        if seq in queue.running:
            queue.running.remove(seq)
        if seq in queue.waiting:
            queue.waiting.remove(seq)
        if free_kv and seq.block_table:
            self.kv_pool.free(seq.model, seq.block_table)
            seq.block_table = []


def _ewma(average: float, seconds: float) -> float:
    return seconds if average == 0.0 else STEP_EWMA * seconds + (1 - STEP_EWMA) * average
