"""`mox serve --ray` end to end: the command (one for the module, with its own local Ray
cluster) running two replicas over demo checkpoints, reached through Ray's HTTP proxy on
loopback."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mox.demo import ensure_demo_models
from mox.fleet.messages import REPLICA_HEADER
from mox.registry import Registry
from tests.conftest import default_sigint

MODELS = ("olmoe-demo", "qwen2-moe-demo")
API_KEY = "fleet-key"
WAIT_S = 60.0                     # bound on every condition the tests wait for
GREEDY = dict(max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(demo_home, tmp_path_factory):
    """`mox serve --ray` as a child process (its own local Ray cluster: Ray never runs in
    the test process, whose memory other tests measure)."""
    home = str(tmp_path_factory.mktemp("fleet_home"))
    registry = Registry(home)
    demo = ensure_demo_models(demo_home)           # built already: the paths
    for name in MODELS:
        registry.add(name, demo[name])
    port = _free_port()
    log_path = os.path.join(home, "serve.log")
    log = open(log_path, "w")                      # the child's; the test reads its own
    process = subprocess.Popen(
        [sys.executable, "-m", "mox.cli", "serve", "--ray", "--replicas", "2", "--home", home,
         "--port", str(port), "--api-key", API_KEY, "--kv-memory", "64MiB",
         "--models-per-replica", "2"], stdout=subprocess.DEVNULL, stderr=log,
        preexec_fn=default_sigint)
    try:
        _wait_for(lambda: process.poll() is not None or "serving 2 models on" in _read(log_path),
                  "mox serve --ray serving")
        assert process.poll() is None, _read(log_path)[-3000:]
        yield {"port": port, "home": home, "demo": demo}
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{fleet['port']}/v1", api_key=API_KEY,
                         max_retries=0, timeout=WAIT_S)


def _get(fleet, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", fleet["port"], timeout=WAIT_S)
    conn.request("GET", path)
    response = conn.getresponse()
    assert response.status == 200, (path, response.status)
    return response.read()


def _wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def _successes(fleet, model: str) -> dict[str, float]:
    """Per replica, the model's finished requests, from the merged /metrics."""
    text = _get(fleet, "/metrics").decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "mox:request_success_total" and s.labels["model"] == model:
                counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return counts


def test_the_openai_client_through_ray(client):
    assert set(MODELS) <= {m.id for m in client.models.list()}
    whole = client.completions.create(model=MODELS[0], prompt="Hello", **GREEDY)
    assert whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODELS[0], prompt="Hello", stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    chat = client.chat.completions.create(
        model=MODELS[1], messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8


def test_errors_and_the_api_key_are_the_replicas(fleet, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    keyless = openai.OpenAI(base_url=f"http://127.0.0.1:{fleet['port']}/v1", api_key="wrong",
                            max_retries=0, timeout=WAIT_S)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()


def test_a_models_requests_land_where_it_is_warm(fleet, client):
    model = MODELS[1]
    client.completions.create(model=model, prompt="warm up", **GREEDY)
    warm_on = _wait_for(lambda: [r for r, rep in json.loads(_get(fleet, "/fleet")).items()
                                 if rep["warmth"].get(model, 0) > 0], "the model warm")
    # whichever replica answers, the fleet's model list has it warm (as the reports do)
    assert client.models.retrieve(model).model_extra["state"] == "warm"
    time.sleep(3.0)        # the routing stats reach the ingress's router (every second)
    before = _successes(fleet, model)
    missed_before = _warm_elsewhere(fleet, model)
    for _ in range(6):
        client.completions.create(model=model, prompt="again", **GREEDY)
    after = _wait_for(lambda: (a := _successes(fleet, model)) and sum(a.values())
                      >= sum(before.values()) + 6 and a, "the metrics report")
    landed = {r: after[r] - before.get(r, 0) for r in after}
    assert sum(landed.get(r, 0) for r in warm_on) == 6, (warm_on, landed)
    # none found it cold where it landed while it was warm elsewhere
    assert _warm_elsewhere(fleet, model) == missed_before


def _warm_elsewhere(fleet, model: str) -> int:
    return sum(rep["landed_warm_elsewhere"].get(model, 0)
               for rep in json.loads(_get(fleet, "/fleet")).values())


def test_a_model_added_to_the_registry_reaches_every_replica(fleet, client):
    Registry(fleet["home"]).add("late-model", fleet["demo"][MODELS[0]])
    _wait_for(lambda: (reports := json.loads(_get(fleet, "/fleet"))) and len(reports) == 2
              and all("late-model" in rep["warmth"] for rep in reports.values()),
              "both replicas serving the new model")
    out = client.completions.create(model="late-model", prompt="Hello", **GREEDY)
    assert out.usage.completion_tokens == 8


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(fleet, client):
    conn = http.client.HTTPConnection("127.0.0.1", fleet["port"], timeout=WAIT_S)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODELS[0], "prompt": "Hello", "max_tokens": 3000, "stream": True,
         "ignore_eos": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    replica = response.getheader(REPLICA_HEADER)
    assert response.readline().startswith(b"data: {")          # the stream has begun
    os.kill(json.loads(_get(fleet, "/fleet"))[replica]["pid"], signal.SIGKILL)
    # (readline took the first event's line, not its blank line: what follows may start
    # with that newline, and the error may come right after it)
    events = [event.strip() for event in response.read().split(b"\n\n") if event.strip()]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["code"] == "replica_unavailable"
    # the next request is served (by the other replica, or the retried one), and Ray
    # restarts the dead replica
    out = client.completions.create(model=MODELS[0], prompt="again", **GREEDY)
    assert out.usage.completion_tokens == 8
    _wait_for(lambda: (reports := json.loads(_get(fleet, "/fleet"))) and len(reports) == 2
              and replica not in reports, "Ray's replacement replica reporting")

