"""Per-expert activation frequencies of one model, which the planner values slots by: every
MoE layer step records the experts it used, in O(k), with exponential decay and lazy updates
(nothing runs between events).

Legend: L MoE layers, E experts per layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# Activation frequencies halve after this long: a few bursts of requests, not yesterday.
USAGE_HALF_LIFE_S = 60.0
# Weight of the uniform prior, in steps: a model with no history looks uniform (k/E per
# expert) rather than "never used", and one step of evidence already counts as much.
USAGE_PRIOR_STEPS = 1.0
# Rescale the lazy-decay weights before they overflow float64 (2**600 ~ 1e180).
_MAX_LOG2_WEIGHT = 600.0


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
