"""Traffic statistics the router plans from: per-model request and token rates over several
time scales, and per-expert activation frequencies. Every update is O(1) (or O(k) for the
experts of one step), so they are called on every request and every MoE layer step.

Both use exponential decay with lazy updates: nothing runs between events.

Legend: L MoE layers, E experts per layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

# The windows the issue asks for: a burst (10 s), the recent minute, the last ten minutes.
RATE_WINDOWS_S = (10.0, 60.0, 600.0)
# Activation frequencies halve after this long: a few bursts of requests, not yesterday.
USAGE_HALF_LIFE_S = 60.0
# Weight of the uniform prior, in steps: a model with no history looks uniform (k/E per
# expert) rather than "never used", and one step of evidence already counts as much.
USAGE_PRIOR_STEPS = 1.0
# Rescale the lazy-decay weights before they overflow float64 (2**600 ~ 1e180).
_MAX_LOG2_WEIGHT = 600.0


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
    last_arrival: float | None = None

    def on_arrival(self, now: float) -> None:
        for window in self.arrivals:
            window.add(now)
        self.last_arrival = now

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


class ExpertUsage:
    """P(a step of layer l uses expert e), decayed with a half-life. Counts are kept in
    growing units (an event at time t weighs 2^(t / half-life)), so the ratio count / steps
    is the decayed frequency with no per-event decay pass over the table."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 half_life_s: float = USAGE_HALF_LIFE_S) -> None:
        self.top_k, self.half_life_s = top_k, half_life_s
        self.counts = np.zeros((num_layers, num_experts))                # [L, E]
        self.steps = np.zeros(num_layers)                                # [L]
        self._origin: float | None = None

    def record(self, moe_layer: int, experts: Iterable[int], now: float) -> None:
        weight = self._weight(now)
        self.counts[moe_layer, list(experts)] += weight
        self.steps[moe_layer] += weight

    def _weight(self, now: float) -> float:
        if self._origin is None:
            self._origin = now
        log2 = (now - self._origin) / self.half_life_s
        if log2 > _MAX_LOG2_WEIGHT:                   # rebase: divide everything by 2^log2
            self.counts *= 2.0 ** -log2
            self.steps *= 2.0 ** -log2
            self._origin, log2 = now, 0.0
        return 2.0 ** log2

    def probabilities(self, now: float) -> np.ndarray:
        """`[L, E]`, smoothed toward the uniform k/E by `USAGE_PRIOR_STEPS` steps of now."""
        num_experts = self.counts.shape[1]
        prior = USAGE_PRIOR_STEPS * self._weight(now)
        uniform = self.top_k / num_experts
        return (self.counts + prior * uniform) / (self.steps[:, None] + prior)
