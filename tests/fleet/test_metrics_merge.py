"""Every replica's Prometheus text merged under a `replica` label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mox.fleet.directory import merge_metrics


def _text(requests: int, running: int) -> str:
    registry = CollectorRegistry()
    Counter("mox:request_success", "Finished requests.", ["model"],
            registry=registry).labels("a").inc(requests)
    Gauge("mox:num_requests_running", "Running.", ["model"],
          registry=registry).labels("a").set(running)
    return generate_latest(registry).decode()


def test_merge_labels_each_sample_with_its_replica():
    merged = merge_metrics({"r0": _text(3, 1), "r1": _text(5, 0)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    totals = {s.labels["replica"]: s.value for s in families["mox:request_success"].samples
              if s.name.endswith("_total")}
    assert totals == {"r0": 3.0, "r1": 5.0}
    running = {s.labels["replica"]: s.value
               for s in families["mox:num_requests_running"].samples}
    assert running == {"r0": 1.0, "r1": 0.0}
    assert merged.count("# TYPE mox:num_requests_running gauge") == 1


def test_merge_of_no_replicas_is_empty():
    assert merge_metrics({}) == b""
