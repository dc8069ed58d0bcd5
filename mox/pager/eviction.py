"""Eviction policies: which unleased resident expert of a model's pool gives up its slot.

Interface (all calls under the pager's lock, so implementations need no locking):
    on_access(key, now)   the expert was used by a step (a hit or a completed load)
    on_access_many(keys, now)   several were, at once (a decode step's hits)
    on_evict(key)         the expert left the pool
    victims(candidates, count, now) -> keys   the `count` (or fewer) of these unleased
                                              resident experts to evict first
    score(key, now) -> float         how much the pool wants to keep it (higher = keep;
                                     comparable within one pool at one `now`)
Keys are (moe_layer, expert).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

ExpertKey = tuple[int, int]
POLICIES = ("lru", "lfu", "rate")
# Activation frequencies halve after this long without use: long enough to span a burst of
# requests, short enough that yesterday's traffic does not pin today's slots.
RATE_HALF_LIFE_S = 60.0


class EvictionPolicy:
    def on_access(self, key: ExpertKey, now: float) -> None:
        raise NotImplementedError

    def on_access_many(self, keys: Iterable[ExpertKey], now: float) -> None:
        for key in keys:
            self.on_access(key, now)

    def on_evict(self, key: ExpertKey) -> None:
        pass

    def score(self, key: ExpertKey, now: float) -> float:
        raise NotImplementedError

    def victims(self, candidates: Iterable[ExpertKey], count: int,
                now: float) -> list[ExpertKey]:
        return heapq.nsmallest(count, candidates, key=lambda key: self.score(key, now))


@dataclass
class LRUPolicy(EvictionPolicy):
    last_used: dict[ExpertKey, float] = field(default_factory=dict)

    def on_access(self, key: ExpertKey, now: float) -> None:
        self.last_used[key] = now

    def on_evict(self, key: ExpertKey) -> None:
        self.last_used.pop(key, None)

    def score(self, key: ExpertKey, now: float) -> float:
        return self.last_used.get(key, -math.inf)


@dataclass
class LFUPolicy(EvictionPolicy):
    """Use counts survive eviction, so an expert that was popular comes back as popular."""

    counts: dict[ExpertKey, int] = field(default_factory=dict)
    last_used: dict[ExpertKey, float] = field(default_factory=dict)

    def on_access(self, key: ExpertKey, now: float) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        self.last_used[key] = now

    def score(self, key: ExpertKey, now: float) -> float:
        # ties (common right after a cold start) go to the least recently used
        return self.counts.get(key, 0) + 1e-12 * self.last_used.get(key, 0.0)


@dataclass
class RatePolicy(EvictionPolicy):
    """Exponentially decayed activation frequency of the expert. (The model's request rate
    scales every score of a pool alike, so within a pool it would change nothing: the router's
    planner weighs models by rate when it divides the budget, mox.router.planner.)

    Every frequency decays by the same factor, so the pool's order never changes between
    accesses: each expert keeps `log(frequency) + now * ln2 / half_life` as of its last
    access, and a score is one lookup (victim choice scans every slot of the pool). The
    history outlives eviction: a popular expert comes back popular."""

    half_life_s: float = RATE_HALF_LIFE_S
    log_freq: dict[ExpertKey, float] = field(default_factory=dict)   # shifted, see above

    def _growth(self, now: float) -> float:
        return now * math.log(2.0) / self.half_life_s

    def frequency(self, key: ExpertKey, now: float) -> float:
        """Decayed activations of `key` at `now` (1 per use, halving every half-life)."""
        shifted = self.log_freq.get(key)
        return 0.0 if shifted is None else math.exp(shifted - self._growth(now))

    def on_access(self, key: ExpertKey, now: float) -> None:
        self.on_access_many((key,), now)

    def on_access_many(self, keys: Iterable[ExpertKey], now: float) -> None:
        # log(frequency + 1) + growth, the growth computed once: a decode step's few dozen
        # hits are counted on the step's critical path
        growth, log_freq, exp, log = self._growth(now), self.log_freq, math.exp, math.log
        for key in keys:
            shifted = log_freq.get(key)
            log_freq[key] = log((0.0 if shifted is None else exp(shifted - growth))
                                + 1.0) + growth

    def score(self, key: ExpertKey, now: float) -> float:
        return self.log_freq.get(key, -math.inf)


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "rate":
        return RatePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose from {POLICIES}")
