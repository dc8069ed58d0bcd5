"""Servers for the HTTP tests, on loopback in a thread with its own event loop:

- `live`: the real app over the router serving two demo checkpoints (RouterBackend).
- `fake`: the real app, with an API key, over `FakeBackend`, whose models misbehave on
  purpose (admission refused, failed model, crashes, mid-stream errors).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable

import pytest

from mox.errors import AdmissionError, ModelNotFoundError, ModelUnavailableError
from mox.messages import FinishReason, ModelState, Request, RequestOutput
from mox.router import Router, RouterConfig
from mox.sampling import NaNLogitsError
from mox.serve import RouterBackend
from mox.server.app import create_app, start_server, stop_server
from mox.server.backend import ModelInfo
from mox.server.chat_template import ChatTemplate
from mox.tokenizer import Tokenizer

DEMO_MODELS = ("olmoe-demo", "qwen2-moe-demo")     # the two fastest demo checkpoints on CPU
KV_MEMORY = 256 << 20
API_KEY = "sekret"
WAIT_S = 15.0                                      # bound on every condition a test waits for


def live_backend(paths: dict[str, str]) -> RouterBackend:
    """`mox serve`'s backend over demo checkpoints, warmed up."""
    router = Router(paths, RouterConfig(kv_memory=KV_MEMORY))
    for name in paths:
        router.warm_up(name)
    return RouterBackend(router)


class FakeBackend:
    """Models by behaviour: `echo` streams three tokens; `busy` refuses admission; `broken`
    failed to load; `crash` raises a bug; `flaky` fails after its first token; `dies` ends
    with an aborted output carrying an engine error; `slow` streams a token every 50 ms until
    `abort_all`."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self._tokenizer, self._template = tokenizer, template
        self.ready = True
        self.retry_after_s = 0.2
        self.names = ("echo", "busy", "broken", "crash", "flaky", "dies", "slow", "nan")
        self.abort_error: Exception | None = None
        self.defaults: dict[str, float | int] = {}      # generation_config.json's
        self.last_request: Request | None = None

    def is_ready(self) -> bool:
        return self.ready

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(n, ModelState.FAILED if n == "broken" else ModelState.WARM, 1,
                          "corrupt shard" if n == "broken" else None) for n in self.names]

    def tokenizer(self, model: str) -> Tokenizer:
        if model not in self.names:
            raise ModelNotFoundError(f"model {model!r} is not served")
        if model == "broken":
            raise ModelUnavailableError("model 'broken' failed to load: corrupt shard")
        return self._tokenizer

    def sampling_defaults(self, model: str) -> dict[str, float | int]:
        self.tokenizer(model)                     # the same errors
        return self.defaults

    def chat_template(self, model: str) -> ChatTemplate:
        self.tokenizer(model)
        return self._template

    async def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        rid = request.request_id
        self.last_request = request
        if request.model == "busy":
            raise AdmissionError("queue full", retry_after_s=self.retry_after_s)
        if request.model == "crash":
            raise RuntimeError("secret internals")
        if request.model == "nan":
            raise NaNLogitsError()
        if request.model == "slow":
            while self.abort_error is None:
                yield RequestOutput(rid, [5], "a")
                await asyncio.sleep(0.05)
            raise self.abort_error
        if request.model == "dies":
            yield RequestOutput(rid, [], "", FinishReason.ABORT, error="checkpoint vanished")
            return
        yield RequestOutput(rid, [5], "a")
        if request.model == "flaky":
            raise RuntimeError("lost the device")
        yield RequestOutput(rid, [6], "b")
        yield RequestOutput(rid, [7], "c", FinishReason.STOP)

    def abort_all(self, error: Exception) -> None:
        self.abort_error = error

    def snapshot(self) -> dict:
        return {"models": {"echo": {"state": "warm", "running": 0, "waiting": 0}},
                "device_budget_bytes": None, "device_used_bytes": 0}


class LiveServer:
    """An app served on 127.0.0.1 (any free port) from a thread with its own event loop."""

    def __init__(self, app) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server",
                                        daemon=True)
        self._thread.start()
        self.runner, self.port = self.call(start_server(app, "127.0.0.1", 0))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        """One raw HTTP exchange: (status, headers, body bytes)."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.call(stop_server(self.runner))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        self.loop.close()


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture(scope="session")
def router_backend(demo_home):
    paths = {name: os.path.join(demo_home, "models", name) for name in DEMO_MODELS}
    backend = live_backend(paths)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def live(router_backend):
    server = LiveServer(create_app(router_backend))
    yield server
    server.close()


@pytest.fixture(scope="session")
def fake_backend(demo_home):
    path = os.path.join(demo_home, "models", DEMO_MODELS[0])
    return FakeBackend(Tokenizer.from_checkpoint(path), ChatTemplate.from_checkpoint(path))


@pytest.fixture(scope="session")
def fake(fake_backend):
    server = LiveServer(create_app(fake_backend, api_key=API_KEY))
    yield server
    server.close()
