"""Faults below the API, through the live server over the router: a checkpoint damaged while
its model is warm fails only that model (503 naming the file, `failed` in /v1/models) and a
verify brings it back once the file is repaired; request fields the engine refuses name
their parameter; a long model name is not reflected; a chat without max_tokens gets the
server's default."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

from mox import serve
from mox.registry import Registry
from mox.router import Router, RouterConfig
from mox.serve import RouterBackend
from mox.server.app import create_app
from mox.server.limits import ServerLimits
from tests.server.conftest import DEMO_MODELS, LiveServer, wait_until

DAMAGED, HEALTHY = DEMO_MODELS
BUDGET = 20 << 20           # both dense weights (8 MiB) and a part of their 36 MiB of experts


@pytest.fixture
def home(tmp_path, demo_home):
    registry = Registry(str(tmp_path))
    for name in DEMO_MODELS:
        copy = os.path.join(str(tmp_path), "models", name)
        shutil.copytree(os.path.join(demo_home, "models", name), copy)
        registry.add(name, copy)
    return str(tmp_path)


def _complete(server: LiveServer, model: str, prompt: list[int], **fields) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, **fields}
    status, _, raw = server.request("POST", "/v1/completions", body)
    return status, json.loads(raw)


def _states(server: LiveServer) -> dict[str, dict]:
    status, _, raw = server.request("GET", "/v1/models")
    assert status == 200
    return {m["id"]: m for m in json.loads(raw)["data"]}


def test_a_checkpoint_damaged_while_warm_fails_only_its_model_until_verified(home):
    registry = Registry(home)
    entries = registry.list()
    router = Router({e.name: e.path for e in entries},
                    RouterConfig(device_memory=BUDGET, kv_memory=64 << 20, direct_io=False))
    backend = RouterBackend(router, entries)
    server = LiveServer(create_app(backend, limits=ServerLimits(default_max_tokens=3)))
    try:
        assert _complete(server, DAMAGED, [5, 6, 7])[0] == 200
        folder = registry.get(DAMAGED).path
        shard = os.path.join(folder, sorted(f for f in os.listdir(folder)
                                            if f.endswith(".safetensors"))[-1])
        saved = open(shard, "rb").read()
        with open(shard, "r+b") as f:
            f.truncate(len(saved) // 2)
        answers = [_complete(server, DAMAGED, [3 + i, 40 + i, 80 - i] * 4) for i in range(12)]
        statuses = [status for status, _ in answers]
        assert 500 not in statuses and 503 in statuses, statuses
        failure = next(body for status, body in answers if status == 503)["error"]
        assert os.path.basename(shard) in failure["message"], failure
        assert failure["type"] == "service_unavailable_error"
        model = _states(server)[DAMAGED]
        assert model["state"] == "failed" and os.path.basename(shard) in model["error"]
        assert _complete(server, HEALTHY, [5, 6, 7])[0] == 200       # the other serves on

        open(shard, "wb").write(saved)                               # repaired, verified
        registry.mark_verified(DAMAGED)
        backend.follow_registry(registry.list())
        assert wait_until(lambda: _states(server)[DAMAGED]["state"] != "failed")
        assert _complete(server, DAMAGED, [5, 6, 7])[0] == 200
        status, _, raw = server.request("POST", "/v1/chat/completions", {
            "model": HEALTHY, "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    finally:
        server.close()
        backend.shutdown()


def test_refused_fields_name_their_parameter(live):
    status, body = _complete(live, DEMO_MODELS[0], [5, 6], stop_token_ids=[10**9])
    assert status == 400 and body["error"]["param"] == "stop_token_ids"
    status, body = _complete(live, DEMO_MODELS[0], [5] * 5000)
    assert status == 400 and body["error"]["param"] == "prompt"
    status, _, raw = live.request("POST", "/v1/chat/completions", {
        "model": DEMO_MODELS[0], "messages": [{"role": "user", "content": "a b " * 5000}]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"


def test_a_long_model_name_is_refused_without_being_reflected(live):
    status, _, raw = live.request("POST", "/v1/completions",
                                  {"model": "m" * 10_000, "prompt": "hi"})
    assert status == 400 and len(raw) < 500
    assert json.loads(raw)["error"]["param"] == "model"


def test_a_model_busy_when_its_files_change_switches_once_idle(home, monkeypatch):
    """`mox models import` or `add --replace` while the model runs: it keeps its files until
    its requests are done, then the next look at the registry serves the new ones (the
    change was once dropped until some other registry write)."""
    registry = Registry(home)
    entries = registry.list()
    router = Router({e.name: e.path for e in entries},
                    RouterConfig(device_memory=BUDGET, kv_memory=64 << 20, direct_io=False))
    backend = RouterBackend(router, entries)
    try:
        old = registry.get(HEALTHY).path
        new = old + "-copy"
        shutil.copytree(old, new)
        registry.add(HEALTHY, new, replace=True)
        busy = {HEALTHY}
        monkeypatch.setattr(router, "has_requests", lambda name: name in busy)
        backend.follow_registry(registry.list())
        assert wait_until(lambda: backend.switch_pending)
        assert router.models[HEALTHY].path == old             # busy: not switched yet
        busy.clear()
        monkeypatch.setattr(serve, "REGISTRY_CHECK_S", 0.05)

        async def watch_until_switched() -> bool:
            # the registry file does not change again: the watcher looks because a switch waits
            watcher = asyncio.create_task(serve._watch_registry(registry, backend))
            try:
                for _ in range(200):
                    if router.models[HEALTHY].path == new:
                        return True
                    await asyncio.sleep(0.05)
                return False
            finally:
                watcher.cancel()

        assert asyncio.run(watch_until_switched())
        assert wait_until(lambda: not backend.switch_pending)
    finally:
        backend.shutdown()
