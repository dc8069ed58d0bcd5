"""The step timeline (records, the JSON-lines step log) and the watchdog."""

from __future__ import annotations

import json
import logging
import time

import pytest

from mox.messages import Request
from mox.router.timeline import DecodeCosts, StepRecord, Watchdog, read_log
from mox.sampling import SamplingParams
from tests.conftest import tiny_router


def test_each_step_leaves_a_record_and_a_log_line(hf_checkpoints, tmp_path):
    log_path = tmp_path / "steps.jsonl"
    router = tiny_router(hf_checkpoints["olmoe"][0], whole=False, step_log=str(log_path))
    try:
        router.add_request(Request("r", "olmoe", list(range(3, 12)),
                                   SamplingParams(max_tokens=3, ignore_eos=True)))
        for _ in range(20):                                   # bounded
            if not router.has_work:
                break
            router.step()
        records = list(router.timeline.records)
        assert [r.num_tokens for r in records] == [9, 1, 1]   # prefill, then two decodes
        assert [r.num_prefill_tokens for r in records] == [9, 0, 0]
        assert all(r.model == "olmoe" and r.num_seqs == 1 and r.seconds > 0 for r in records)
        # warmed up with its dense weights only and never used: nothing to read ahead by
        assert records[0].misses > 0 and records[0].waves >= 1
    finally:
        router.shutdown()
    steps, events = read_log(str(log_path))
    assert [r.num_tokens for r in steps] == [9, 1, 1]
    # its load (started by the warm-up, dense weights only) and its landing came first
    assert [(e.event, e.model, e.preload) for e in events] == [("load", "olmoe", 0),
                                                                ("landed", "olmoe", 0)]
    assert events[0].start <= events[1].start <= steps[0].start
    assert json.loads(log_path.read_text().splitlines()[0])["event"] == "load"


def test_the_watchdog_reports_a_long_step_and_what_it_waits_on(caplog):
    state = {"now": None}
    caplog.set_level(logging.WARNING, logger="mox.steps")
    watchdog = Watchdog(lambda: state["now"], threshold_s=5.0, period_s=0.01)
    try:
        state["now"] = (2.0, "computing")
        time.sleep(0.05)
        assert watchdog.reports == 0                         # under the threshold
        state["now"] = (6.0, "waiting for reads of 3 experts")
        deadline = time.monotonic() + 5.0
        while watchdog.reports == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert watchdog.reports == 1                         # once, until it doubles
        state["now"] = (13.0, "waiting for reads of 3 experts")
        deadline = time.monotonic() + 5.0
        while watchdog.reports == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watchdog.reports == 2
    finally:
        watchdog.stop()
    assert "step running for 6.0 s: waiting for reads of 3 experts" in caplog.text


def test_decode_costs_price_a_token_and_a_miss_from_decode_steps():
    costs = DecodeCosts()
    assert costs.seconds_per_token is None and costs.seconds_per_miss is None
    costs.add(StepRecord(0.0, "a", 1, 64, 64, 2.0, misses=90))            # a prefill: not counted
    assert costs.seconds_per_token is None
    costs.add(StepRecord(2.0, "a", 2, 2, 0, 0.06))                        # 30 ms a token
    costs.add(StepRecord(2.1, "a", 2, 2, 0, 0.26, stall_seconds=0.05, parked_seconds=0.15,
                         misses=2))                                       # 100 ms a miss
    assert costs.seconds_per_token == pytest.approx(0.03, rel=0.01)
    assert costs.seconds_per_miss == pytest.approx(0.1, rel=0.01)
