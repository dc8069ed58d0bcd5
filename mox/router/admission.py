"""Admission: which requests the router accepts, how long they may wait, and what a refused
client is told. Per-model and global limits on waiting requests (AdmissionError, HTTP 429 with
a Retry-After from the recent finish rate); a request still waiting after the queue timeout is
expired (RequestTimeoutError). Single-threaded, on the router's thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mox.errors import AdmissionError
from mox.router.rates import DecayedRate

# Retry-After bounds: at least a second (HTTP's unit), at most a minute (beyond that the
# estimate is worthless and the client should back off on its own).
RETRY_AFTER_BOUNDS_S = (1.0, 60.0)
# The finish rate behind Retry-After follows the last ~10 s: recent enough to track a burst.
FINISH_RATE_WINDOW_S = 10.0


@dataclass
class Tracked:
    model: str
    arrival: float
    started: bool = False           # produced output (no longer subject to the queue timeout)


class Admission:
    def __init__(self, max_waiting_per_model: int, max_waiting: int,
                 queue_timeout_s: float) -> None:
        self.max_waiting_per_model = max_waiting_per_model
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self._requests: dict[str, Tracked] = {}
        self._finishes = DecayedRate(FINISH_RATE_WINDOW_S)

    def check(self, model: str, waiting: int, total_waiting: int, now: float) -> None:
        """Raise AdmissionError if `model` (with `waiting` requests waiting, of
        `total_waiting` in all) may not queue one more."""
        if waiting >= self.max_waiting_per_model:
            why = f"model {model!r} has {waiting} requests waiting"
        elif total_waiting >= self.max_waiting:
            why = f"the server has {total_waiting} requests waiting"
        else:
            return
        rate = self._finishes.rate(now)
        low, high = RETRY_AFTER_BOUNDS_S
        retry = high if rate <= 0 else min(high, max(low, total_waiting / rate))
        raise AdmissionError(f"{why}; try again later", retry_after_s=retry)

    def track(self, request_id: str, model: str, now: float) -> None:
        self._requests[request_id] = Tracked(model, now)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def on_output(self, request_id: str, finished: bool, now: float) -> str | None:
        """The request produced output; returns its model (None: not tracked)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        tracked.started = True
        if finished:
            del self._requests[request_id]
            self._finishes.add(now)
        return tracked.model

    def of_model(self, model: str) -> list[str]:
        return [rid for rid, t in self._requests.items() if t.model == model]

    def oldest_arrival(self, model: str) -> float:
        return min((t.arrival for t in self._requests.values() if t.model == model),
                   default=math.inf)

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(request, model) of the requests that waited past the queue timeout without
        output."""
        return [(rid, t.model) for rid, t in self._requests.items()
                if not t.started and now - t.arrival > self.queue_timeout_s]

    def next_expiry(self) -> float | None:
        """When the next waiting request times out (None: none waits, or none ever times out:
        the offline API's infinite timeout)."""
        if math.isinf(self.queue_timeout_s):
            return None
        return min((t.arrival + self.queue_timeout_s for t in self._requests.values()
                    if not t.started), default=None)
