"""What one model's expert accesses say about its memory needs, recorded by every MoE layer
step with exponential decay and lazy updates (nothing runs between events):

- `ExpertUsage`: P(a step of layer l uses expert e): which experts are popular (prefetch).
- `MissRatioCurve`: the hit rate an LRU pool of every size would get on the recent accesses,
  from LRU stack distances: what each slot is worth to the planner.

Legend: L MoE layers, E experts per layer, N = L * E (every key a slot can hold).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import numpy as np

# Activation frequencies halve after this long: a few bursts of requests, not yesterday.
USAGE_HALF_LIFE_S = 60.0
# Weight of the uniform prior, in steps: a model with no history looks uniform (k/E per
# expert) rather than "never used", and one step of evidence already counts as much.
USAGE_PRIOR_STEPS = 1.0
# Rescale the lazy-decay weights before they overflow float64 (2**600 ~ 1e180).
_MAX_LOG2_WEIGHT = 600.0


class GrowingWeights:
    """Exponential decay in growing units: an event at time t weighs 2^(t / half-life), so sums
    of weights are decayed counts (divide by `weight(now)`) with no per-event decay pass. The
    arrays it is given are rescaled in place before the weights overflow float64."""

    def __init__(self, half_life_s: float, *arrays: np.ndarray) -> None:
        self.half_life_s = half_life_s
        self._arrays = arrays
        self._origin: float | None = None

    def weight(self, now: float) -> float:
        if self._origin is None:
            self._origin = now
        log2 = (now - self._origin) / self.half_life_s
        if log2 > _MAX_LOG2_WEIGHT:                   # rebase: divide everything by 2^log2
            for array in self._arrays:
                array *= 2.0 ** -log2
            self._origin, log2 = now, 0.0
        return 2.0 ** log2

    @property
    def time_constant_s(self) -> float:
        """A decayed count / this = events per second."""
        return self.half_life_s / math.log(2.0)


class ExpertUsage:
    """P(a step of layer l uses expert e), decayed with a half-life."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 half_life_s: float = USAGE_HALF_LIFE_S) -> None:
        self.top_k = top_k
        self.counts = np.zeros((num_layers, num_experts))                # [L, E]
        self.steps = np.zeros(num_layers)                                # [L]
        self._decay = GrowingWeights(half_life_s, self.counts, self.steps)

    def record(self, steps: Iterable[tuple[int, Iterable[int]]], now: float) -> None:
        """Layer steps at `now`: each `(moe_layer, experts)` (distinct) used its experts."""
        weight, counts, layer_steps = self._decay.weight(now), self.counts, self.steps
        for moe_layer, experts in steps:
            row = counts[moe_layer]
            for expert in experts:    # (a decode's few: cheaper than one fancy-indexed add)
                row[expert] += weight
            layer_steps[moe_layer] += weight

    def probabilities(self, now: float) -> np.ndarray:
        """`[L, E]`, smoothed toward the uniform k/E by `USAGE_PRIOR_STEPS` steps of now."""
        num_experts = self.counts.shape[1]
        prior = USAGE_PRIOR_STEPS * self._decay.weight(now)
        uniform = self.top_k / num_experts
        return (self.counts + prior * uniform) / (self.steps[:, None] + prior)


# Keys a miss-ratio curve tracks exactly; larger key spaces are sampled down to about this.
EXACT_KEYS = 2048
# A record of more accesses than this sorts the keys' last uses (O(N log N)) rather than
# comparing every access with every key (O(kN)): equal at about this many on 512 keys.
SORT_ABOVE_ACCESSES = 8
# A record of several layer steps compares each access with the others' (O(n^2)): above
# this many accesses it records them in turn (a decode step of a few sequences is below).
GROUPED_ACCESSES = 128


def _spatial_hash(keys: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random mixing of key numbers (Knuth's multiplicative hash), so a sample
    of keys is spread over layers and experts."""
    return (keys.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)


class MissRatioCurve:
    """Hit rate at every pool size from LRU stack distances of (layer, expert) keys.

    An access's stack distance is the number of distinct keys used since its key's last use,
    itself included: an LRU pool of S slots hits it iff distance <= S. The experts of one layer
    step are looked up together, then become most recent in the order given, as an LRU pool
    would see them. Each record counts, per access, the tracked keys used since: exact up to
    `EXACT_KEYS` keys; above that, a fixed spatial sample of about `EXACT_KEYS` of them is
    tracked (SHARDS: a sampled key's distance among sampled keys, times the sampling ratio,
    estimates its distance among all), since a 48 x 128 model's full sort took 4 ms a token
    step. Counts decay with a half-life, so the curve follows phase changes."""

    def __init__(self, num_keys: int, half_life_s: float = USAGE_HALF_LIFE_S) -> None:
        self.num_keys = num_keys
        self.ratio = max(1, -(-num_keys // EXACT_KEYS))            # 1: every key tracked
        tracked = np.arange(num_keys)[_spatial_hash(np.arange(num_keys)) % self.ratio == 0]
        self._slot = np.full(num_keys, -1)                         # key -> tracked index
        self._slot[tracked] = np.arange(len(tracked))
        self.last_use = np.full(len(tracked), -np.inf)             # [tracked keys]
        # [N + 1] decayed accesses by distance d = 1..N at d - 1; [N]: first uses (cold)
        self.counts = np.zeros(num_keys + 1)
        self._tick = 0
        self._decay = GrowingWeights(half_life_s, self.counts)

    def record(self, keys: np.ndarray, now: float, sizes: list[int] | None = None) -> None:
        """`keys [k]`: distinct flat keys (layer * E + expert) used by one layer step (the
        pager passes a set's; not checked here, on every layer of every step). Several layer
        steps of one model step at once: `keys` concatenated, `sizes` each one's count, no key
        in two of them (each is another layer); counted as records of each in turn would be,
        bit for bit, in a few numpy calls rather than a dozen per layer."""
        if sizes is not None and len(keys) > GROUPED_ACCESSES:     # n^2 past this: in turn
            for start, size in zip(itertools.accumulate(sizes, initial=0), sizes):
                self.record(keys[start:start + size], now)
            return
        slots = self._slot[keys]
        group = (np.repeat(np.arange(len(sizes)), sizes) if sizes is not None and len(sizes) > 1
                 else None)
        if self.ratio > 1:
            tracked = slots >= 0
            slots, group = slots[tracked], None if group is None else group[tracked]
        before = self.last_use[slots]
        seen = before > -np.inf
        last = before[seen]                                          # seen before
        # keys used at or after each one's last use: a comparison per (access, key) for a
        # decode's few accesses, a sort of the keys' times for a prefill's many
        if len(last) <= SORT_ABOVE_ACCESSES:
            distance = (self.last_use >= last[:, None]).sum(axis=1)
        else:
            order = np.sort(self.last_use)
            distance = len(order) - np.searchsorted(order, last, side="left")
        if group is not None:     # and the keys of earlier steps, used since, not yet counted
            distance += ((before < last[:, None]) & (group < group[seen, None])).sum(axis=1)
        weight = self._decay.weight(now) * self.ratio           # each stands for `ratio`
        if self.ratio > 1:
            distance = np.minimum(1 + (distance - 1) * self.ratio, self.num_keys)  # itself, once
        if self.ratio == 1 and group is None:
            # distinct last uses give distinct distances: a plain indexed add is exact
            self.counts[distance - 1] += weight
        else:                                       # in order, as records in turn add them
            np.add.at(self.counts, distance - 1, weight)
        if group is None:
            self.counts[-1] += weight * (len(slots) - len(last))
        else:
            cold = np.bincount(group[~seen], minlength=len(sizes))
            np.add.at(self.counts, np.full(len(sizes), -1), weight * cold)
        self.last_use[slots] = np.arange(self._tick, self._tick + len(slots))
        self._tick += len(slots)

    def hit_rates(self) -> np.ndarray:
        """`[N + 1]`: H(S), the share of recent accesses an LRU pool of S slots would hit
        (0 with no history)."""
        total = self.counts.sum()
        hits = np.concatenate([[0.0], np.cumsum(self.counts[:-1])])
        return hits / total if total > 0 else hits

    def recent_accesses(self, now: float) -> float:
        """The decayed count of (layer, expert) accesses the curve is made of."""
        return self.counts.sum() / self._decay.weight(now)

    def access_rate(self, now: float) -> float:
        """Recent (layer, expert) accesses per second."""
        return self.recent_accesses(now) / self._decay.time_constant_s
