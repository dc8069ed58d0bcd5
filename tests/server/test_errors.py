"""Every error case answers with its status and an OpenAI error body, and the server keeps
serving afterwards."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY, DEMO_MODELS

MODEL = DEMO_MODELS[0]
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _post(server, path: str, body, headers=None) -> tuple[int, dict, dict]:
    status, response_headers, raw = server.request("POST", path, body, headers)
    return status, response_headers, _error(raw)


TOO_LONG = [1] * 4096       # the demo models' context is 4096 positions


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b'{"model": "x", "prompt": ', 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {**GOOD, "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {**GOOD, "prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [5000]}, 400, "prompt"),       # outside the vocab
    # an asked-for limit past the context (4090 + 7 > 4096): refused, as vLLM does
    ("/v1/completions", {**GOOD, "prompt": TOO_LONG[:-6], "max_tokens": 7}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 1}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
])
def test_bad_requests_then_a_good_one(live, path, body, status, param):
    got_status, headers, error = _post(live, path, body)
    assert (got_status, error["param"]) == (status, param), error
    assert headers["Content-Type"].startswith("application/json")
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"
    if isinstance(body, dict) and (body.get("prompt") is TOO_LONG
                                   or param in ("max_tokens", "max_completion_tokens")):
        assert "context of 4096" in error["message"] or "context is 4096" in error["message"]
    good_status, _, good = live.request("POST", "/v1/completions", GOOD)
    assert good_status == 200 and json.loads(good)["usage"]["completion_tokens"] >= 1


def test_a_default_limit_ends_at_the_context(live):
    """Without max_tokens the output runs to the context's end ("length"); an asked-for limit
    that reaches the context exactly is served."""
    prompt = TOO_LONG[:-6]                  # 4090 tokens: room for 6 more
    for body in ({"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": True},
                 {"model": MODEL, "prompt": prompt, "ignore_eos": True}):   # default 16
        status, _, raw = live.request("POST", "/v1/completions", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["finish_reason"] == "length"


def test_oversize_body_is_413(live):
    body = json.dumps({**GOOD, "prompt": "x" * (2 << 20)}).encode()
    status, _, error = _post(live, "/v1/completions", body)
    assert status == 413 and error["code"] == "request_too_large"
    assert live.request("POST", "/v1/completions", GOOD)[0] == 200


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing-here", 404), ("POST", "/nope", 404), ("GET", "/v1/completions", 405),
])
def test_unknown_routes_answer_in_openai_shape(live, method, path, status):
    got, _, raw = live.request(method, path)
    assert got == status and path in _error(raw)["message"]


def test_openai_client_sees_typed_errors(live):
    client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": ""}])


def test_api_key_is_required_except_for_probes(fake):
    body = {"model": "echo", "prompt": "hi"}
    assert _post(fake, "/v1/completions", body)[0] == 401
    status, headers, error = _post(fake, "/v1/completions", body, {"Authorization": "Bearer nope"})
    assert (status, error["code"]) == (401, "invalid_api_key")
    assert headers["WWW-Authenticate"] == "Bearer"
    assert _post(fake, "/v1/completions", body, {"Authorization": f"Basic {API_KEY}"})[0] == 401
    # the scheme's case is free
    assert fake.request("POST", "/v1/completions", body,
                        {"Authorization": f"bearer {API_KEY}"})[0] == 200
    assert fake.request("GET", "/v1/models")[0] == 401
    assert fake.request("GET", "/health")[0] == 200
    assert fake.request("GET", "/metrics")[0] == 200
    status, _, raw = fake.request("POST", "/v1/completions", body, AUTH)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "abc"


@pytest.mark.parametrize("retry_after_s, header", [(0.2, "1"), (2.5, "3")])
@pytest.mark.parametrize("stream", [False, True])
def test_admission_refusal_is_429_with_retry_after(fake, fake_backend, retry_after_s, header,
                                                   stream):
    fake_backend.retry_after_s = retry_after_s
    status, headers, error = _post(fake, "/v1/completions",
                                   {"model": "busy", "prompt": "hi", "stream": stream}, AUTH)
    assert (status, headers["Retry-After"], error["code"]) == (429, header,
                                                               "rate_limit_exceeded")


@pytest.mark.parametrize("model, status, message", [
    ("broken", 503, "corrupt shard"),
    ("crash", 500, "internal server error"),           # a bug: nothing of it leaks
    ("dies", 500, "checkpoint vanished"),
    ("nan", 500, "a damaged or badly converted checkpoint?)"),   # a known fault: said
])
def test_backend_failures(fake, model, status, message):
    for path, body in [("/v1/completions", {"model": model, "prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"model": model, "messages": [{"role": "user", "content": "hi"}]})]:
        got, _, error = _post(fake, path, body, AUTH)
        assert got == status and error["message"].endswith(message)
        assert "secret" not in error["message"]


def test_failed_model_is_listed_with_its_reason(fake):
    status, _, raw = fake.request("GET", "/v1/models", headers=AUTH)
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    assert cards["broken"]["state"] == "failed" and cards["broken"]["error"] == "corrupt shard"
    assert cards["echo"]["state"] == "warm" and "error" not in cards["echo"]


def test_health_is_503_until_ready(fake, fake_backend):
    fake_backend.ready = False
    try:
        status, _, raw = fake.request("GET", "/health")
        assert status == 503 and _error(raw)["type"] == "service_unavailable_error"
    finally:
        fake_backend.ready = True
    assert fake.request("GET", "/health")[0] == 200
