"""The load generator against a fake OpenAI server: SSE parsing, the cold probe, errors, and
a replay that sends in the workload's order at its relative times; the /metrics parser."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from mox.bench.loadtest.loadgen import LoadGenerator, parse_metrics, replay
from mox.bench.loadtest.workload import RequestSpec

# The schedule is checked loosely: the test machine is a shared 2-core box.
SCHEDULE_SLACK_S = 0.25
FAKE_LOAD_S = 0.05                # a cold model of the fake server loads this long
RECEIVED = web.AppKey("received", list)


def _fake_app(states: dict[str, str]) -> web.Application:
    received: list[tuple[str, int]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        received.append((body["model"], len(body["prompt"])))
        assert body["stream"] and body["ignore_eos"] and body["stream_options"]
        if body["model"] == "missing":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        if states.get(body["model"]) == "cold":
            states[body["model"]] = "loading"
            await asyncio.sleep(FAKE_LOAD_S)
        states[body["model"]] = "warm"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            finish = "length" if i == body["max_tokens"] - 1 else None
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": finish}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": m, "state": s} for m, s in states.items()]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app[RECEIVED] = received
    return app


async def _with_server(states, body):
    app = _fake_app(states)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            return await body(LoadGenerator(session, f"http://127.0.0.1:{port}"),
                              app[RECEIVED])
    finally:
        await runner.cleanup()


def test_replay_sends_in_order_at_relative_times_and_measures():
    specs = [RequestSpec(0, 0.0, "a", 5, 4, 1), RequestSpec(1, 0.3, "b", 7, 1, 2),
             RequestSpec(2, 0.35, "a", 3, 3, 3), RequestSpec(3, 0.8, "missing", 2, 2, 4)]
    states = {"a": "cold", "b": "warm"}

    async def body(generator, received):
        results = await replay(generator, specs, deadline_s=30.0)
        return results, list(received)

    results, received = asyncio.run(_with_server(states, body))
    assert [(m, n) for m, n in received] == [("a", 5), ("b", 7), ("a", 3), ("missing", 2)]
    assert [r.index for r in results] == [0, 1, 2, 3]
    for spec, r in zip(specs, results):
        assert abs(r.sent_s - spec.arrival_s) < SCHEDULE_SLACK_S
    sent = [r.sent_s for r in results]
    assert sent == sorted(sent)
    assert abs((sent[1] - sent[0]) - 0.3) < SCHEDULE_SLACK_S
    a0, b, a1, missing = results
    assert a0.is_ok and a0.num_output_tokens == 4 and len(a0.itl_s) == 3
    assert a0.finish_reason == "length" and a0.tpot_s is not None
    assert a0.cold and not b.cold and not a1.cold          # "a" was cold at its first arrival
    assert b.num_output_tokens == 1 and b.tpot_s is None
    assert not missing.is_ok and "HTTP 404" in missing.error


def test_requests_past_the_deadline_are_reported_not_sent():
    specs = [RequestSpec(0, 0.0, "a", 2, 2, 1), RequestSpec(1, 5.0, "a", 2, 2, 2)]

    async def body(generator, received):
        return await replay(generator, specs, deadline_s=1.0), list(received)

    results, received = asyncio.run(_with_server({"a": "warm"}, body))
    assert len(received) == 1 and results[0].is_ok
    assert "not sent" in results[1].error


def test_parse_metrics():
    text = """# HELP mox:expert_hits_total Expert leases served from a resident slot.
# TYPE mox:expert_hits_total counter
mox:expert_hits_total{model="a"} 42.0
mox:expert_hits_total{model="b"} 1.0
mox:time_to_first_token_seconds_bucket{le="0.1",model="a"} 3.0
mox:model_state{model="a",state="cold"} 0.0
mox:model_state{model="a",state="warm"} 1.0
mox:device_used_bytes 2.80192e+07
"""
    sample = parse_metrics(text, 1.5)
    assert sample.value("mox:expert_hits_total", "a") == 42.0
    assert sample.total("mox:expert_hits_total") == 43.0
    assert sample.value("mox:device_used_bytes") == 2.80192e07
    assert sample.states == {"a": "warm"}
    assert "mox:time_to_first_token_seconds_bucket" not in sample.values
    assert sample.t_s == 1.5


def test_parse_metrics_adds_up_a_fleets_replicas():
    text = """mox:expert_hits_total{model="a",replica="r0"} 40.0
mox:expert_hits_total{model="a",replica="r1"} 2.0
mox:device_used_bytes{replica="r0"} 100.0
mox:device_used_bytes{replica="r1"} 50.0
mox:model_state{model="a",replica="r0",state="warm"} 1.0
mox:model_state{model="a",replica="r1",state="cold"} 1.0
"""
    sample = parse_metrics(text, 0.0)
    assert sample.value("mox:expert_hits_total", "a") == 42.0
    assert sample.value("mox:device_used_bytes") == 150.0
    assert sample.states == {"a": "warm"}            # warm on any replica
