"""ServerMetrics: request observations and the scrape-time snapshot, in the exposition text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mox.server.metrics import ServerMetrics

SNAPSHOT = {
    "models": {
        "a": {"state": "warm", "running": 1, "waiting": 2, "request_rate": 0.5,
              "dense_resident": True, "planned_slots": 10,
              "pager": {"hits": 5, "misses": 2, "bytes_read": 1024, "resident_bytes": 2048,
                        "num_slots": 10, "held_slots": 14, "evictions": 3, "read_seconds": 0.0125,
                        "prefetches": 4, "prefetch_hits": 3,
                        "page_in_buckets": (0.001, 0.01), "page_in_counts": [1, 2, 0]}},
        "b": {"state": "failed", "running": 0, "waiting": 0},      # no pager: not reported
    },
    "device_budget_bytes": None,
    "device_used_bytes": 100,
}


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def test_snapshot_becomes_gauges_and_counters():
    samples = _samples(ServerMetrics(lambda: SNAPSHOT))
    a = (("model", "a"),)
    assert samples[("mox:num_requests_running", a)] == 1
    assert samples[("mox:num_requests_waiting", a)] == 2
    assert samples[("mox:request_rate", a)] == 0.5
    assert samples[("mox:dense_resident", a)] == 1
    assert samples[("mox:expert_hits_total", a)] == 5
    assert samples[("mox:expert_misses_total", a)] == 2
    assert samples[("mox:expert_bytes_read_total", a)] == 1024
    assert samples[("mox:expert_evictions_total", a)] == 3
    assert samples[("mox:expert_prefetches_total", a)] == 4
    assert samples[("mox:expert_prefetch_hits_total", a)] == 3
    assert samples[("mox:resident_expert_bytes", a)] == 2048
    # the plan (a pool drains or grows to it) and what the pool holds now
    assert samples[("mox:planned_expert_slots", a)] == 10
    assert samples[("mox:expert_slots", a)] == 14
    assert ("mox:expert_hits_total", (("model", "b"),)) not in samples
    assert samples[("mox:model_state", (("model", "b"), ("state", "failed")))] == 1
    assert samples[("mox:model_state", (("model", "b"), ("state", "warm")))] == 0
    assert samples[("mox:device_used_bytes", ())] == 100
    assert ("mox:device_budget_bytes", ()) not in samples       # None: no budget


def test_page_ins_come_from_the_snapshot_as_a_histogram():
    samples = _samples(ServerMetrics(lambda: SNAPSHOT))
    a = (("model", "a"),)
    assert samples[("mox:expert_page_in_seconds_bucket", (("le", "0.001"), ("model", "a")))] == 1
    assert samples[("mox:expert_page_in_seconds_bucket", (("le", "0.01"), ("model", "a")))] == 3
    assert samples[("mox:expert_page_in_seconds_bucket", (("le", "+Inf"), ("model", "a")))] == 3
    assert samples[("mox:expert_page_in_seconds_count", a)] == 3
    assert abs(samples[("mox:expert_page_in_seconds_sum", a)] - 0.0125) < 1e-12
    assert ("mox:expert_page_in_seconds_count", (("model", "b"),)) not in samples


def test_requests_are_observed():
    metrics = ServerMetrics(lambda: {"models": {}})
    metrics.observe_request("a", prompt_tokens=4, ttft_s=0.02, itls=[0.01, 0.03], e2e_s=0.1,
                            generation_tokens=3, finish_reason="length")
    samples = _samples(metrics)
    a = (("model", "a"),)
    assert samples[("mox:time_to_first_token_seconds_count", a)] == 1
    assert samples[("mox:inter_token_latency_seconds_count", a)] == 2
    assert abs(samples[("mox:inter_token_latency_seconds_sum", a)] - 0.04) < 1e-9
    assert samples[("mox:e2e_request_latency_seconds_count", a)] == 1
    assert samples[("mox:prompt_tokens_total", a)] == 4
    assert samples[("mox:generation_tokens_total", a)] == 3
    assert samples[("mox:request_success_total",
                    (("finished_reason", "length"), ("model", "a")))] == 1


def test_a_failing_snapshot_does_not_fail_the_scrape():
    def broken() -> dict:
        raise RuntimeError("router gone")

    metrics = ServerMetrics(broken)
    metrics.observe_request("a", prompt_tokens=1, ttft_s=0.01, itls=[], e2e_s=0.01,
                            generation_tokens=1, finish_reason="stop")
    assert ("mox:time_to_first_token_seconds_count", (("model", "a"),)) in _samples(metrics)


def test_each_server_has_its_own_registry():
    one, two = ServerMetrics(lambda: {}), ServerMetrics(lambda: {})
    one.observe_request("a", prompt_tokens=1, ttft_s=0.01, itls=[], e2e_s=0.01,
                        generation_tokens=1, finish_reason="stop")
    assert ("mox:time_to_first_token_seconds_count", (("model", "a"),)) not in _samples(two)
