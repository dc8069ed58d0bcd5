"""What the pager learns from accesses: the miss-ratio curve against an exact LRU simulation,
and its decay."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.pager.usage import EXACT_KEYS, MissRatioCurve

NUM_KEYS = 64


def lru_hit_rate(trace: list[list[int]], size: int) -> float:
    """An LRU pool of `size` slots on the trace, each step's keys resident together (a wave):
    the share of accesses that found their key resident."""
    pool: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for step in trace:
        hits += sum(key in pool for key in step)
        total += len(step)
        for key in step:
            pool[key] = None
            pool.move_to_end(key)
        while len(pool) > size:
            pool.popitem(last=False)
    return hits / total


def zipf_trace(rng: np.random.Generator, steps: int, per_step: int) -> list[list[int]]:
    weights = 1.0 / np.arange(1, NUM_KEYS + 1)
    keys = rng.permutation(NUM_KEYS)
    return [sorted(set(keys[rng.choice(NUM_KEYS, per_step, p=weights / weights.sum())]))
            for _ in range(steps)]


def curve_of(trace: list[list[int]]) -> np.ndarray:
    curve = MissRatioCurve(NUM_KEYS, half_life_s=1e9)           # no decay: the whole trace
    for t, step in enumerate(trace):
        curve.record(np.asarray(step), float(t))
    return curve.hit_rates()


def test_single_key_steps_match_exact_lru_at_every_size():
    trace = [[k] for k in np.random.default_rng(0).zipf(1.3, 3000) % NUM_KEYS]
    hit_rates = curve_of(trace)
    for size in range(1, NUM_KEYS + 1):
        assert hit_rates[size] == pytest.approx(lru_hit_rate(trace, size), abs=1e-6)


def test_layer_steps_match_exact_lru_at_every_size():
    """A step's keys are looked up together, then inserted in order, as the pool sees them."""
    rng = np.random.default_rng(1)
    for per_step in (4, 12, 32):              # both ways of counting distances
        trace = zipf_trace(rng, 1000, per_step)
        hit_rates = curve_of(trace)
        for size in range(1, NUM_KEYS + 1):
            assert hit_rates[size] == pytest.approx(lru_hit_rate(trace, size), abs=1e-6)


def test_the_curve_follows_a_phase_change():
    curve = MissRatioCurve(NUM_KEYS, half_life_s=10.0)
    for t in range(300):                            # a cycle over 32 keys: a cliff at 32
        curve.record(np.array([t % 32]), float(t))
    assert curve.hit_rates()[31] < 0.05 and curve.hit_rates()[32] > 0.85
    for t in range(300, 600):                       # then a hot set of 4 keys
        curve.record(np.array([t % 4]), float(t))
    assert curve.hit_rates()[4] > 0.85
    assert curve.access_rate(600.0) == pytest.approx(1.0, rel=0.1)   # one access a second


def test_a_large_key_space_is_sampled_and_estimated_within_seven_points():
    """Sampling spreads the estimated distances (measured: 3-6 points low at 1/32 to 1/2 of
    the keys on this trace); exact tracking would cost a sort of every key per layer step."""
    num_keys = 4 * EXACT_KEYS                                   # a quarter of keys tracked
    rng = np.random.default_rng(2)
    weights = 1.0 / np.arange(1, num_keys + 1) ** 0.8
    keys = rng.permutation(num_keys)[rng.choice(num_keys, 20000, p=weights / weights.sum())]
    trace = [[int(k)] for k in keys]
    curve = MissRatioCurve(num_keys, half_life_s=1e9)
    assert curve.ratio == 4 and len(curve.last_use) < num_keys
    for t, step in enumerate(trace):
        curve.record(np.asarray(step), float(t))
    hit_rates = curve.hit_rates()
    for size in (256, 1024, 2048, 4096):
        assert abs(hit_rates[size] - lru_hit_rate(trace, size)) < 0.07, size


@pytest.mark.parametrize("num_keys", [512, 4 * EXACT_KEYS])     # every key, a quarter of them
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.lists(st.integers(1, 10), min_size=1, max_size=12), min_size=1,
                      max_size=20),                    # (at most 120 a step: all at once)
       seed=st.integers(0, 2**32 - 1))
def test_layer_steps_recorded_at_once_count_as_in_turn_bit_for_bit(num_keys, steps, seed):
    """A decode step's layers in one record (the pager's hold) against a record per layer at
    the same instant: the same counts, bit for bit, with decay weights that round (a weight
    of 1.0 would hide an addition done in another order), and the same recency."""
    rng = np.random.default_rng(seed)
    at_once, in_turn = (MissRatioCurve(num_keys, half_life_s=7.0) for _ in range(2))
    for t, sizes in enumerate(steps):
        sizes = sizes[:num_keys // 10]                      # distinct keys across the layers
        keys = rng.permutation(num_keys)[:sum(sizes)]
        now = 0.37 * t
        at_once.record(keys, now, sizes)
        for start, size in zip(np.cumsum([0, *sizes[:-1]]), sizes):
            in_turn.record(keys[start:start + size], now)
    assert np.array_equal(at_once.counts, in_turn.counts)
    assert np.array_equal(at_once.last_use, in_turn.last_use)
