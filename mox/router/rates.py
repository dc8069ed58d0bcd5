"""Traffic statistics the router plans from: per-model request and token rates over several
time scales. Every update is O(1), so they are called on every request and every step.
Exponential decay with lazy updates: nothing runs between events. (Per-expert activation
frequencies are the pager's: mox.pager.usage.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The windows the issue asks for: a burst (10 s), the recent minute, the last ten minutes.
RATE_WINDOWS_S = (10.0, 60.0, 600.0)


@dataclass
class DecayedRate:
    """Events per second, exponentially weighted with time constant `window_s`."""

    window_s: float
    _value: float = 0.0
    _at: float | None = None

    def add(self, now: float, count: float = 1.0) -> None:
        self._value = self.rate(now) + count / self.window_s
        self._at = now

    def rate(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now - self._at) / self.window_s)


def _windows() -> list[DecayedRate]:
    return [DecayedRate(w) for w in RATE_WINDOWS_S]


@dataclass
class ModelTraffic:
    """One model's arrivals and generated tokens, each over `RATE_WINDOWS_S`."""

    arrivals: list[DecayedRate] = field(default_factory=_windows)
    tokens: list[DecayedRate] = field(default_factory=_windows)

    def on_arrival(self, now: float) -> None:
        for window in self.arrivals:
            window.add(now)

    def on_tokens(self, now: float, count: int) -> None:
        for window in self.tokens:
            window.add(now, count)

    def request_rates(self, now: float) -> tuple[float, ...]:
        return tuple(w.rate(now) for w in self.arrivals)

    def request_rate(self, now: float) -> float:
        """What the planner values memory by: rises with a burst at once (the short window)
        and falls with the minute's average, so a model keeps its slots between the requests
        of steady traffic."""
        short, minute, _ = self.request_rates(now)
        return max(short, minute)

    def is_rising(self, now: float) -> bool:
        short, minute, _ = self.request_rates(now)
        return short > minute

    def token_rate(self, now: float) -> float:
        return self.tokens[0].rate(now)
