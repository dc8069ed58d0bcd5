"""Prometheus metrics, vLLM-style names under `mox:` with a `model` label.

Two sources: the server observes each request as it finishes (latency histograms, token and
success counters), and at scrape time a collector asks the backend for a snapshot of the
router's and pager's state (queues, rates, expert hits and misses, resident bytes, and the
pager's histogram of expert read times). The
registry is this object's own, so two servers in one process never share series.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from mox.messages import ModelState

log = logging.getLogger("mox.server")

# Buckets as vLLM's (seconds), so dashboards built for it read mox the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# snapshot key -> (metric, help) for the per-model scalars
_MODEL_GAUGES = {
    "running": ("mox:num_requests_running", "Requests running on the engine."),
    "waiting": ("mox:num_requests_waiting", "Requests waiting to be scheduled."),
    "request_rate": ("mox:request_rate", "Smoothed request rate (requests/s)."),
    "dense_resident": ("mox:dense_resident", "1 if the dense weights are on the device."),
    "planned_slots": ("mox:planned_expert_slots", "Expert slots the planner gives the model."),
}
_PAGER_COUNTERS = {
    "hits": ("mox:expert_hits_total", "Expert leases served from a resident slot."),
    "misses": ("mox:expert_misses_total", "Expert leases that had to page the expert in."),
    "bytes_read": ("mox:expert_bytes_read_total", "Expert bytes read from host or disk."),
    "bytes_read_disk": ("mox:expert_bytes_read_disk_total", "Expert bytes read from disk."),
    "bytes_read_host": ("mox:expert_bytes_read_host_total",
                        "Expert bytes read from the host (RAM) cache."),
    "evictions": ("mox:expert_evictions_total", "Experts evicted from their slots."),
    "prefetches": ("mox:expert_prefetches_total",
                   "Experts loaded ahead of use (next-layer prediction, popular experts)."),
    "prefetch_hits": ("mox:expert_prefetch_hits_total",
                      "Prefetched experts a step then used: the prediction's hits."),
    "preloads": ("mox:expert_preloads_total",
                 "Experts read with a cold start's dense weights (its run size)."),
    "mapped_reads": ("mox:expert_mapped_reads_total",
                     "Misses computed in place from pinned host memory (GPU) while they load."),
    "graph_captures": ("mox:decode_graph_captures_total",
                       "Decode steps captured as CUDA graphs (a batch size first met, or the "
                       "pools or KV store moved)."),
    "graph_capture_seconds": ("mox:decode_graph_capture_seconds_total",
                              "Seconds spent capturing decode graphs."),
}
_PAGER_GAUGES = {
    "resident_bytes": ("mox:resident_expert_bytes", "Expert bytes resident on the device."),
    "held_slots": ("mox:expert_slots", "Expert slots the model holds (it drains or grows to "
                   "the planned count)."),
}

_DEVICE_GAUGES = {
    "device_budget_bytes": "Device bytes mox may use for weights and KV.",
    "device_used_bytes": "Device bytes mox uses now.",
}


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("mox:time_to_first_token_seconds", "Time to first token.",
                              ["model"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("mox:inter_token_latency_seconds", "Time between tokens.",
                             ["model"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("mox:e2e_request_latency_seconds", "Request latency, end to end.",
                             ["model"], buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("mox:prompt_tokens_total", "Prompt tokens processed.",
                                     ["model"], registry=self.registry)
        self.generation_tokens = Counter("mox:generation_tokens_total", "Tokens generated.",
                                         ["model"], registry=self.registry)
        self.request_success = Counter("mox:request_success_total", "Requests finished.",
                                       ["model", "finished_reason"], registry=self.registry)
        self.registry.register(SnapshotCollector(snapshot))

    def observe_request(self, model: str, prompt_tokens: int, ttft_s: float,
                        itls: list[float], e2e_s: float, generation_tokens: int,
                        finish_reason: str) -> None:
        self.ttft.labels(model).observe(ttft_s)
        itl = self.itl.labels(model)
        for seconds in itls:
            itl.observe(seconds)
        self.e2e.labels(model).observe(e2e_s)
        self.count_tokens(model, prompt_tokens, generation_tokens)
        self.request_success.labels(model, finish_reason).inc()

    def count_tokens(self, model: str, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens processed: every request's, also those cut short (a disconnect)."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generation_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class SnapshotCollector:
    """Reads `snapshot()` (the shape `ServingBackend.snapshot` documents) at each scrape."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []      # names are not known before the first snapshot; skip the check

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self.snapshot()
        except Exception:   # noqa: BLE001 - a failing snapshot must not fail the scrape
            log.exception("metrics snapshot failed")
            return
        models: dict[str, dict] = snap.get("models", {})
        yield from _per_model(models, _MODEL_GAUGES, GaugeMetricFamily, lambda m: m)
        yield from _per_model(models, _PAGER_COUNTERS, CounterMetricFamily,
                              lambda m: m.get("pager", {}))
        yield from _per_model(models, _PAGER_GAUGES, GaugeMetricFamily,
                              lambda m: m.get("pager", {}))
        yield _page_ins(models)
        yield _model_states(models)
        for key, help_text in _DEVICE_GAUGES.items():
            if snap.get(key) is not None:     # no budget: serving everything resident
                gauge = GaugeMetricFamily(f"mox:{key}", help_text)
                gauge.add_metric([], float(snap[key]))
                yield gauge


def _per_model(models: dict[str, dict], spec: dict[str, tuple[str, str]], family: type,
               section: Callable[[dict], dict]) -> Iterator[Metric]:
    for key, (name, help_text) in spec.items():
        metric = family(name, help_text, labels=["model"])
        for model, state in sorted(models.items()):
            value = section(state).get(key)
            if value is not None:
                metric.add_metric([model], float(value))
        yield metric


def _page_ins(models: dict[str, dict]) -> Metric:
    """The pager's read times (bucket bounds and per-bucket counts, the last unbounded) as a
    cumulative Prometheus histogram."""
    metric = HistogramMetricFamily("mox:expert_page_in_seconds", "Time to read one expert in.",
                                   labels=["model"])
    for model, state in sorted(models.items()):
        pager = state.get("pager", {})
        if "page_in_counts" not in pager:
            continue
        bounds = [str(float(b)) for b in pager["page_in_buckets"]] + ["+Inf"]
        cumulative = list(itertools.accumulate(pager["page_in_counts"]))
        metric.add_metric([model], list(zip(bounds, cumulative)),
                          float(pager.get("read_seconds", 0.0)))
    return metric


def _model_states(models: dict[str, dict]) -> Metric:
    """One-hot: 1 for the model's current state, 0 for the others."""
    metric = GaugeMetricFamily("mox:model_state", "1 for the model's current state.",
                               labels=["model", "state"])
    for model, state in sorted(models.items()):
        for candidate in ModelState:
            metric.add_metric([model, candidate.value],
                              float(state.get("state") == candidate.value))
    return metric
