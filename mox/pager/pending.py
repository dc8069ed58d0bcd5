"""Reads a step waits for, handed to whoever drives the step.

A MoE layer whose routed experts are still being read cannot finish its step until they land.
Instead of blocking the only thread that computes, the layer's wave iterator yields a
`ReadsPending` up through the forward pass (a generator), so its driver may run another
model's step meanwhile and resume this one once `done`. A driver with nothing else to do
resumes it at once, and the pass then blocks in `wait()`, which counts the stall.
`run_to_end` is that simplest driver: a forward pass run as one blocking call.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from mox.pager.paging import PagedPool

T = TypeVar("T")


@dataclass(frozen=True)
class ReadsPending:
    """Loads of `experts` of one MoE layer of `pool`'s model, in flight."""

    pool: PagedPool
    moe_layer: int
    experts: tuple[int, ...]
    futures: tuple[Future, ...]

    @property
    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        """Block until every read landed (the time counts as the pool's stall); a failed read
        raises its error (naming the file)."""
        blocks = not self.done
        if blocks:
            self.pool.waiting_on = (f"reads of {len(self.experts)} experts of MoE layer "
                                    f"{self.moe_layer} ({self.pool.loader.reader.num_queued()} "
                                    "reads queued on the I/O threads)")
        start = time.perf_counter()
        try:
            for future in self.futures:
                future.result()
        finally:
            if blocks:
                self.pool.waiting_on = None
                self.pool.count_stall(time.perf_counter() - start)


def run_to_end(steps: Generator[ReadsPending | None, None, T]) -> T:
    """Drive a step to its result, waiting wherever it waits for reads (it may also yield
    None where it could pause)."""
    while True:
        try:
            pending = next(steps)
        except StopIteration as finished:
            return finished.value
        if pending is not None:
            pending.wait()
