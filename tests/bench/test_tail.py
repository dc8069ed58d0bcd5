"""The tail attribution of `mox bench` runs (bench/loadtest/tail.py) on a synthetic step log."""

import pytest

from mox.bench.loadtest.results_schema import RequestRecord
from mox.bench.loadtest.tail import decode_shares, slowest
from mox.router.timeline import StepRecord

MiB = 2**20


def test_the_slowest_first_token_is_split_by_its_models_prompt_step():
    origin = 100.0
    requests = [RequestRecord(0, "a", 0.0, 1.0, True, 32, 8, False, ttft_s=3.0),
                RequestRecord(1, "b", 0.0, 0.5, False, 32, 8, True, ttft_s=0.3),
                RequestRecord(2, "b", 9.0, 9.0, False, 32, 0, False, error="cut")]
    steps = [StepRecord(100.55, "b", 1, 32, 32, 0.25),                   # request 1's prompt
             StepRecord(101.2, "a", 1, 1, 0, 0.02),                      # a's earlier decode
             StepRecord(101.5, "b", 1, 1, 0, 0.2, bytes_read=MiB, parked_seconds=0.1),
             StepRecord(102.0, "a", 1, 32, 32, 2.0, stall_seconds=1.5, bytes_read=100 * MiB,
                        parked_seconds=0.3),
             StepRecord(104.5, "b", 1, 1, 0, 0.2)]                       # after a's token
    tail = slowest(requests, steps, origin, n=5)
    assert [t.index for t in tail] == [0, 1]           # slowest first; the failed one is out
    a = tail[0]
    assert a.before_step_s == pytest.approx(1.0) and a.step_s == 2.0
    assert (a.stall_s, a.parked_s, a.step_read_mib) == (1.5, 0.3, 100)
    assert a.others_steps == 1 and a.others_s == pytest.approx(0.1) and a.others_read_mib == 1
    b = tail[1]
    assert b.before_step_s == pytest.approx(0.05) and b.step_s == 0.25 and b.others_steps == 0


def test_decode_time_is_split_into_own_steps_other_models_steps_and_the_rest():
    # a's 5 tokens decode from 1.0 s to 2.0 s after the replay's start (4 intervals)
    requests = [RequestRecord(0, "a", 0.0, 0.0, False, 8, 5, True, ttft_s=1.0, tpot_s=0.25,
                              e2e_s=2.0)]
    steps = [StepRecord(0.9, "a", 1, 1, 0, 0.2),                  # half inside the window
             StepRecord(1.1, "b", 1, 1, 0, 0.4, parked_seconds=0.2),
             StepRecord(1.5, "a", 1, 1, 0, 0.3, stall_seconds=0.1),
             StepRecord(1.9, "b", 1, 1, 0, 0.2)]                  # half inside
    d = decode_shares(requests, steps, origin=0.0, tpot_p50_s=0.25)
    assert d.tpot_p50_ms == 250
    assert d.own_ms == pytest.approx(1e3 * (0.1 + 0.2) / 4)
    assert d.own_stall_ms == pytest.approx(1e3 * 0.1 / 4)
    assert d.others_ms == pytest.approx(1e3 * (0.2 + 0.1) / 4)     # b's parked time is not b's
    assert d.own_ms + d.own_stall_ms + d.others_ms + d.rest_ms == pytest.approx(250)
