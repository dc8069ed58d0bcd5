"""Load-test workloads: which model each request goes to, when, and how long it is.

Two generators behind one interface (`Workload.requests(models) -> list[RequestSpec]`, sorted
by arrival, deterministic for a seed):

- `SyntheticWorkload`: N models with Zipf(alpha) popularity (the model of rank i gets a
  share of the total rate proportional to i^-alpha); each model's arrivals are a Gamma
  renewal process with its rate and a coefficient of variation (CV = 1 is Poisson, higher is
  burstier: shape 1/CV^2, mean gap 1/rate); prompt and output lengths are lognormal with a
  mean and a CV, clipped to a range.
- `TraceWorkload`: a CSV with columns `timestamp, model, input_tokens, output_tokens` (the
  shape of the public Azure LLM inference traces; timestamps in seconds or as date-times).
  Trace models map onto mox models round-robin in order of first appearance; order and
  relative timing are kept (optionally sped up).

Prompts are token ids drawn from each request's own seed, so a replay and the routing
statistics (bench/loadtest/routing_stats.py) see the same prompts.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import msgspec
import numpy as np

from mox.errors import MoxError

# Prompt token ids come from this range: above the demo tokenizer's special tokens and within
# every preset's vocabulary (the demo tokenizer trains to ~670 tokens on its corpus).
PROMPT_TOKEN_RANGE = (16, 512)
TRACE_COLUMNS = ("timestamp", "model", "input_tokens", "output_tokens")


class RequestSpec(msgspec.Struct, frozen=True):
    """One request of a workload. `arrival_s`: seconds after the replay starts."""

    index: int
    arrival_s: float
    model: str
    num_prompt_tokens: int
    max_tokens: int
    seed: int

    def prompt_token_ids(self) -> list[int]:
        rng = np.random.default_rng(self.seed)
        low, high = PROMPT_TOKEN_RANGE
        return rng.integers(low, high, size=self.num_prompt_tokens).tolist()


class Workload(Protocol):
    """A workload generator: `requests(models)` maps the workload onto the mox model names
    given (in popularity order where the workload has one) and returns every request, sorted
    by arrival; the same generator and models give the same requests."""

    def requests(self, models: list[str]) -> list[RequestSpec]: ...


class LengthDistribution(msgspec.Struct, frozen=True):
    """Lognormal with this mean and coefficient of variation, rounded, clipped to
    [minimum, maximum]; cv = 0 gives the mean every time."""

    mean: float
    cv: float
    minimum: int
    maximum: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cv == 0:
            values = np.full(n, self.mean)
        else:
            sigma2 = math.log1p(self.cv**2)
            values = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), n)
        return np.clip(np.rint(values), self.minimum, self.maximum).astype(int)


def zipf_shares(num_models: int, alpha: float) -> np.ndarray:
    """Share of the traffic of the model of each rank (1..N): i^-alpha, normalized."""
    weights = np.arange(1, num_models + 1, dtype=float) ** -float(alpha)
    return weights / weights.sum()


def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float,
                   duration_s: float) -> np.ndarray:
    """Arrival times in [0, duration_s) of a stationary Gamma renewal process: gaps with mean
    1/rate and coefficient of variation cv, observed from a random moment, so any window
    holds rate x its length requests on average. The first arrival is the time left of the gap
    that moment falls in (a length-biased gap, Gamma(shape + 1), times a uniform). Started at
    an arrival instead, a bursty process (cv 2: most gaps tiny) sent each model's first few
    requests at once: 8 models at 0.4 req/s for 240 s averaged 107 requests, not 96, and the
    first 10 s held 11 of them against 4 in any later 10 s."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    first = rng.uniform() * rng.gamma(shape + 1.0, scale)
    times: list[np.ndarray] = [np.array([first])]
    start = first
    batch = max(16, int(2 * rate * duration_s))
    while start < duration_s:
        chunk = start + np.cumsum(rng.gamma(shape, scale, batch))
        times.append(chunk)
        start = chunk[-1]
    all_times = np.concatenate(times)
    return all_times[all_times < duration_s]


@dataclass(frozen=True)
class SyntheticWorkload:
    rate: float                      # total requests/s over all models
    duration_s: float
    alpha: float = 1.0               # Zipf exponent of model popularity
    cv: float = 2.0                  # of each model's inter-arrival gaps
    prompt: LengthDistribution = LengthDistribution(32, 0.5, 4, 128)
    output: LengthDistribution = LengthDistribution(32, 0.5, 4, 64)
    seed: int = 0
    max_requests: int | None = None  # keep the earliest this many

    def requests(self, models: list[str]) -> list[RequestSpec]:
        rng = np.random.default_rng(self.seed)
        shares = zipf_shares(len(models), self.alpha)
        arrivals = [(t, model) for model, share in zip(models, shares)
                    for t in gamma_arrivals(rng, self.rate * share, self.cv, self.duration_s)]
        arrivals.sort()
        arrivals = arrivals[:self.max_requests]
        prompts = self.prompt.sample(rng, len(arrivals))
        outputs = self.output.sample(rng, len(arrivals))
        seeds = rng.integers(0, 2**31, len(arrivals))
        return [RequestSpec(i, float(t), model, int(p), int(o), int(s))
                for i, ((t, model), p, o, s) in enumerate(zip(arrivals, prompts, outputs, seeds))]


class TraceError(MoxError):
    """The trace CSV is missing a column, has a value that is not a number or time, or has
    no rows."""


@dataclass(frozen=True)
class TraceWorkload:
    path: str
    speedup: float = 1.0             # 2.0 replays the trace's gaps at half their length
    duration_s: float | None = None  # drop requests arriving later (after the speed-up)
    max_requests: int | None = None
    seed: int = 0
    max_prompt_tokens: int | None = None    # clip lengths to what the models can take
    max_output_tokens: int | None = None

    def requests(self, models: list[str]) -> list[RequestSpec]:
        rows = read_trace(self.path)
        if not rows:
            return []
        t0 = rows[0][0]
        mapping: dict[str, str] = {}
        rng = np.random.default_rng(self.seed)
        out = []
        for t, trace_model, num_in, num_out in rows:
            arrival = (t - t0) / self.speedup
            if self.duration_s is not None and arrival >= self.duration_s:
                break
            if self.max_requests is not None and len(out) >= self.max_requests:
                break
            model = mapping.setdefault(trace_model, models[len(mapping) % len(models)])
            out.append(RequestSpec(len(out), arrival, model,
                                   _clip(num_in, self.max_prompt_tokens),
                                   _clip(num_out, self.max_output_tokens),
                                   int(rng.integers(0, 2**31))))
        return out


def _clip(value: int, limit: int | None) -> int:
    return max(1, value if limit is None else min(value, limit))


def read_trace(path: str) -> list[tuple[float, str, int, int]]:
    """(seconds, model, input tokens, output tokens) per row, in timestamp order (a stable
    sort, so rows with equal timestamps keep the file's order)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = {c.strip().lower(): c for c in reader.fieldnames or ()}
        missing = [c for c in TRACE_COLUMNS if c not in columns]
        if missing:
            raise TraceError(f"{path}: missing column(s) {missing}; a trace needs "
                             f"{', '.join(TRACE_COLUMNS)}")
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append((_seconds(row[columns["timestamp"]]), row[columns["model"]].strip(),
                             int(float(row[columns["input_tokens"]])),
                             int(float(row[columns["output_tokens"]]))))
            except ValueError as e:
                raise TraceError(f"{path}:{line}: {e}") from e
    if not rows:
        raise TraceError(f"{path}: no requests (a header and no rows)")
    rows.sort(key=lambda r: r[0])
    return rows


def _seconds(value: str) -> float:
    """A number of seconds, or a date-time such as the Azure traces' `2023-11-16
    18:15:46.6805900` (fractions beyond microseconds are cut)."""
    value = value.strip()
    try:
        return float(value)
    except ValueError:
        pass
    head, dot, frac = value.partition(".")
    stamp = datetime.fromisoformat(head + (dot + frac[:6] if dot else ""))
    return stamp.timestamp()


@dataclass(frozen=True)
class SuitePlan:
    """One suite of a load test (one routing skew): its models, device budget and requests."""

    name: str
    routing_skew: float
    models: dict[str, str]              # name -> checkpoint, in popularity order
    dense_bytes: int
    expert_bytes: int
    device_budget_bytes: int
    requests: list[RequestSpec]
