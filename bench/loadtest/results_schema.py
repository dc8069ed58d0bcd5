"""The schema of results.json: msgspec Structs, `Results` being the whole file. The figures
are computed by mox.bench.loadtest.summaries, which defines them."""

from __future__ import annotations

import msgspec

from mox.bench.loadtest.routing_stats import RoutingStats
from mox.bench.loadtest.workload import LengthDistribution

SCHEMA_VERSION = 2


class SLO(msgspec.Struct):
    ttft_ms: float
    tpot_ms: float


class BenchConfig(msgspec.Struct, kw_only=True):
    quick: bool
    preset: str                       # demo | mid | bench (mox.demo)
    architecture: str
    num_models: int
    alpha: float
    cv: float
    rate: float                       # total requests/s
    duration_s: float
    prompt: LengthDistribution
    output: LengthDistribution
    device_memory_fraction: float     # of all expert bytes, on top of all dense bytes
    routing_skews: list[float]
    policies: list[str]
    slo: SLO
    trace: str | None = None
    trace_speedup: float = 1.0
    seed: int = 0
    host_memory: str | None = None
    kv_memory: str = "512MiB"
    scrape_period_s: float = 1.0
    routing_sequences: int = 8
    home: str | None = None           # where the models are built (MOX_HOME)
    out: str = "."
    quantize: str | None = None       # experts int8 | int4 | fp8 (the budget counts bf16's)
    expert_major: bool = False        # the models repacked as `mox models import` leaves them
    tpot_target: bool = False         # every server keeps the SLO's TPOT (serve --tpot-target)
    ray_replicas: int = 0             # > 0: rate also through `mox serve --ray` (budget / N each)
    ray_models_per_replica: int = 0   # > 0: `mox serve --ray --models-per-replica`


class Summary(msgspec.Struct):
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class Latency(msgspec.Struct):
    """Seconds. `cold_ttft`/`warm_ttft`: TTFT of cold / warm arrivals."""

    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    cold_ttft: Summary
    warm_ttft: Summary


class Pager(msgspec.Struct):
    hits: int
    misses: int
    hit_rate: float | None
    bytes_read: int
    peak_resident_bytes: int
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    prefetches: int = 0              # experts loaded on a prediction (next layer, popular)
    prefetch_hits: int = 0           # ... that a step then used
    preloads: int = 0                # read with a cold start's dense weights (its run size)


class Counts(msgspec.Struct):
    requests: int
    ok: int
    failed: int
    cold: int
    met_slo: int
    output_tokens: int


class ModelResult(msgspec.Struct):
    model: str
    counts: Counts
    throughput_tokens_per_s: float
    goodput_requests_per_s: float
    latency: Latency
    pager: Pager


class TimelinePoint(msgspec.Struct):
    t_s: float
    device_used_bytes: float
    resident_bytes: dict[str, float]
    request_rate: dict[str, float]
    page_cache_bytes: float = 0.0       # checkpoint files in the OS page cache (all models)
    bytes_read: float = 0.0             # expert bytes read so far (all models, disk and host)


class RequestRecord(msgspec.Struct, omit_defaults=True):
    """One request (seconds, rounded to 0.1 ms); `error` set when it failed."""

    index: int
    model: str
    arrival_s: float
    sent_s: float
    cold: bool
    num_prompt_tokens: int
    num_output_tokens: int
    met_slo: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


class ReplicaResult(msgspec.Struct):
    """One replica of a Ray run: requests that landed there per model, how many found the
    model warm (its dense weights on) and how many found it held (in the replica's multiplexed
    set: routed to where it lives, though the budget may have parked it), how many found it
    cold there but warm on another replica (routing's misses; the rest of the cold found it
    warm nowhere: the budget's), and each model's warmth there as the run ended
    (mox.fleet.warmth)."""

    replica: str
    landed: dict[str, int]
    landed_warm: dict[str, int]
    warmth: dict[str, float]
    landed_held: dict[str, int] = {}
    landed_warm_elsewhere: dict[str, int] = {}


class PolicyResult(msgspec.Struct, kw_only=True):
    policy: str
    error: str | None = None
    server_exit_code: int | None = None
    startup_s: float = 0.0
    makespan_s: float = 0.0
    load_average_1m: float | None = None    # the machine's, as the replay ended (2 = 2 cores)
    counts: Counts | None = None
    throughput_tokens_per_s: float = 0.0
    throughput_requests_per_s: float = 0.0
    goodput_requests_per_s: float = 0.0
    latency: Latency | None = None
    pager: Pager | None = None
    peak_device_used_bytes: int = 0
    # RAM the OS page cache held for the checkpoints (mincore, sampled): outside mox's budget
    peak_page_cache_bytes: int = 0
    errors: dict[str, int] = {}
    per_model: list[ModelResult] = []
    timeline: list[TimelinePoint] = []
    requests: list[RequestRecord] = []
    replicas: list[ReplicaResult] = []      # a Ray run's (`mox bench --ray N`)
    # `time.monotonic()` at the replay's start: request and timeline times count from it, and
    # a server's step log (`--step-log`) uses the same clock (bench/loadtest/tail.py)
    origin_monotonic_s: float | None = None

    @property
    def warm_share(self) -> float | None:
        """Of a Ray run's requests, the share that landed where their model was warm."""
        return self._landing_share("landed_warm")

    @property
    def held_share(self) -> float | None:
        """... the share that landed on a replica holding their model."""
        return self._landing_share("landed_held")

    @property
    def routed_warm_share(self) -> float | None:
        """... of the requests whose model was warm on some replica, the share that landed on
        one where it was."""
        warm = sum(n for r in self.replicas for n in r.landed_warm.values())
        could = warm + sum(n for r in self.replicas for n in r.landed_warm_elsewhere.values())
        return warm / could if could else None

    @property
    def first_touches(self) -> int:
        """Requests sent before any request of their model had its first token: no server
        could have had that model warm for them (the workload's floor on cold starts)."""
        first_token: dict[str, float] = {}
        for r in self.requests:
            if r.ttft_s is not None:
                t = r.sent_s + r.ttft_s
                first_token[r.model] = min(t, first_token.get(r.model, t))
        return sum(r.sent_s <= first_token.get(r.model, float("inf")) for r in self.requests)

    def _landing_share(self, field: str) -> float | None:
        landed = sum(n for r in self.replicas for n in r.landed.values())
        found = sum(n for r in self.replicas for n in getattr(r, field).values())
        return found / landed if landed else None


class Target(msgspec.Struct):
    """One of the issue's targets: rate's figure / a baseline's, in the same run."""

    figure: str                       # "goodput", "TPOT p50", ...
    baseline: str                     # the policy compared against
    bound: float
    at_most: bool                     # the ratio must be <= bound (else >=)
    ratio: float | None = None        # None: a policy missing or failed
    met: bool | None = None

    @property
    def condition(self) -> str:
        """`<= 0.33x`, `>= 1.50x`"""
        return f"{'<=' if self.at_most else '>='} {self.bound:.2f}x"

    @property
    def verdict(self) -> str:
        return "-" if self.met is None else ("met" if self.met else "missed")


class Workload(msgspec.Struct):
    num_requests: int
    offered_rate: float               # requests/s over the workload's span
    mean_prompt_tokens: float
    mean_output_tokens: float
    model_shares: dict[str, float]    # measured share of requests per model


class Suite(msgspec.Struct):
    name: str
    routing_skew: float
    models: list[str]
    dense_bytes: int
    expert_bytes: int
    device_budget_bytes: int
    workload: Workload
    routing: RoutingStats | None
    policies: list[PolicyResult]
    targets: list[Target]


class Results(msgspec.Struct):
    schema_version: int
    created: str
    machine: str
    wall_s: float
    config: BenchConfig
    suites: list[Suite]
