"""SSE framing, mid-stream errors, metrics after traffic, and client disconnects."""

from __future__ import annotations

import json
import socket

import pytest

from tests.server.conftest import API_KEY, DEMO_MODELS, WAIT_S, wait_until

MODEL = DEMO_MODELS[0]
# An aborted request is gone within a few engine steps; the 4000 tokens it asked for take tens
# of seconds on a CPU, so a request that was not aborted cannot pass this bound.
ABORT_WAIT_S = 5.0


def _events(raw: bytes) -> list[bytes]:
    """Split an SSE body into its `data: ` payloads, checking the framing exactly."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), raw
    return [e[len(b"data: "):] for e in events]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
def test_sse_framing(live, path, body):
    request = {"model": MODEL, "stream": True, "max_tokens": 3, "ignore_eos": True,
               "stream_options": {"include_usage": True}, "unknown_field": {"x": 1}, **body}
    status, headers, raw = live.request("POST", path, request)
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    *chunks, usage, done = _events(raw)
    assert done == b"[DONE]" and len(chunks) == 3
    chunks = [json.loads(c) for c in chunks]
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert json.loads(usage)["choices"] == []
    assert json.loads(usage)["usage"]["completion_tokens"] == 3


def test_no_usage_chunk_unless_asked(live):
    status, _, raw = live.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 2, "ignore_eos": True})
    *chunks, done = _events(raw)
    assert done == b"[DONE]" and all("usage" not in json.loads(c) for c in chunks)


def test_mid_stream_failure_is_an_error_event_then_done(fake):
    status, _, raw = fake.request("POST", "/v1/completions",
                                  {"model": "flaky", "prompt": "hi", "stream": True},
                                  {"Authorization": f"Bearer {API_KEY}"})
    first, error, done = _events(raw)
    assert status == 200 and json.loads(first)["choices"][0]["text"] == "a"
    assert json.loads(error)["error"]["type"] == "server_error" and done == b"[DONE]"


def test_metrics_report_requests_and_the_router(live):
    live.request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    status, headers, raw = live.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for line in (f'mox:time_to_first_token_seconds_count{{model="{MODEL}"}}',
                 f'mox:generation_tokens_total{{model="{MODEL}"}}',
                 f'mox:expert_hits_total{{model="{MODEL}"}}',
                 f'mox:model_state{{model="{MODEL}",state="warm"}} 1.0',
                 "mox:device_used_bytes "):
        assert line in text, line


def _raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request_and_frees_its_kv(live, router_backend, stream):
    engine = router_backend.router.engine
    assert wait_until(lambda: engine.num_live == 0)
    kv_before = engine.kv_pool.used_bytes
    tokens_before = _tokens_counted(live)
    # long enough that it is certainly still running when the client leaves
    sock = _raw_request(live.port, {"model": MODEL, "prompt": "Tell me a story",
                                    "max_tokens": 4000, "ignore_eos": True, "stream": stream})
    if stream:
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
    else:
        assert wait_until(lambda: engine.num_live == 1)
    # live from its arrival; its KV blocks come with its first step
    assert wait_until(lambda: engine.kv_pool.used_bytes > kv_before)
    sock.close()
    assert wait_until(lambda: engine.num_live == 0 and engine.kv_pool.used_bytes == kv_before,
                      ABORT_WAIT_S)
    engine.kv_pool.check_integrity()
    if stream:                  # the tokens it was sent count, though it never finished
        prompt, generated = _tokens_counted(live)
        assert prompt > tokens_before[0] and generated >= tokens_before[1] + 2


def _tokens_counted(live) -> tuple[float, float]:
    """The model's prompt and generation token counters, from /metrics."""
    text = live.request("GET", "/metrics")[2].decode()
    return tuple(next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(f'mox:{kind}_tokens_total{{model="{MODEL}"}}')), 0.0)
                 for kind in ("prompt", "generation"))


def test_a_models_sampling_defaults_fill_what_a_request_leaves_out(fake, fake_backend):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    fake_backend.defaults = {"temperature": 0.25, "top_k": 7}
    try:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            status, _, _ = fake.request("POST", path, {"model": "echo", **body}, auth)
            params = fake_backend.last_request.params
            assert status == 200 and (params.temperature, params.top_k) == (0.25, 7)
            status, _, _ = fake.request("POST", path, {"model": "echo", "top_k": 2, **body},
                                        auth)
            assert fake_backend.last_request.params.top_k == 2
    finally:
        fake_backend.defaults = {}
