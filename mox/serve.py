"""`mox serve`: the registry's models behind the router, behind the OpenAI-compatible server.

    registry.json -> Router (memory plan, engine) -> AsyncEngine (its own thread)
                  -> RouterBackend (the server's one dependency) -> aiohttp app

The server follows the registry while it runs: models added with `mox models add` start
serving, removed ones stop (their requests abort). SIGINT/SIGTERM stop accepting, give
in-flight requests the shutdown grace, end the rest with an error, and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import datetime

from aiohttp import web

from mox.errors import MoxError
from mox.messages import ModelState, Request, RequestOutput
from mox.registry import ModelEntry, Registry
from mox.router import Router, RouterConfig
from mox.router.driver import AsyncEngine
from mox.server.app import create_app, start_server, stop_server
from mox.server.backend import ModelInfo
from mox.server.chat_template import ChatTemplate
from mox.server.limits import ServerLimits
from mox.tokenizer import Tokenizer

log = logging.getLogger("mox.serve")
# How often the registry file's mtime is compared: a model added from the CLI serves within
# about this long, and a stat() per second costs nothing.
REGISTRY_CHECK_S = 1.0


class RouterBackend:
    """The router, driven by AsyncEngine's thread, as the HTTP layer's `ServingBackend`.
    Changes to the model table run on the engine thread (`AsyncEngine.call`)."""

    def __init__(self, router: Router, entries: list[ModelEntry] = ()) -> None:
        self.router = router
        self.created = {e.name: _unix(e.added) for e in entries}
        self._entries = {e.name: e for e in entries}     # as last read from the registry
        self._templates: dict[str, ChatTemplate] = {}
        # a model whose files changed while it had requests: follow the registry again
        self.switch_pending = False
        self.async_engine = AsyncEngine(router)

    def is_ready(self) -> bool:
        """Ready once the models the policy loads at start-up (all-resident) have landed;
        other policies load on demand, so at once."""
        if not self.router.policy.pins_models:
            return True
        return all(m.state != ModelState.LOADING for m in list(self.router.models.values()))

    def models(self) -> list[ModelInfo]:
        now = int(time.time())
        return [ModelInfo(name, m.state, self.created.get(name, now), m.error, m.settings)
                for name, m in list(self.router.models.items())]

    def tokenizer(self, model: str) -> Tokenizer | None:
        return self.router.served(model).tokenizer

    def chat_template(self, model: str) -> ChatTemplate:
        served = self.router.served(model)
        if model not in self._templates:
            self._templates[model] = ChatTemplate.from_checkpoint(served.path)
        return self._templates[model]

    def sampling_defaults(self, model: str) -> dict[str, float | int]:
        return self.router.served(model).sampling_defaults

    def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        return self.async_engine.generate(request)

    def abort_all(self, error: Exception) -> None:
        self.async_engine.abort_all(error)

    def snapshot(self) -> dict:
        return self.router.snapshot()

    def follow_registry(self, entries: list[ModelEntry]) -> None:
        """Serve exactly the registry's models (on the engine thread). A failed model whose
        entry changed (`mox models add --replace`, `verify`) is opened again; a model whose
        files changed (`import`, `add --replace`) while it had requests switches once they
        are done (`switch_pending`: the registry watcher calls again until then)."""
        wanted = {e.name: e for e in entries}
        seen, self._entries = self._entries, dict(wanted)

        def apply(router: Router) -> None:
            pending = False
            for name in [n for n in router.models if n not in wanted]:
                self.async_engine.deliver(router.remove_model(name))
                self._templates.pop(name, None)
                log.info("model %s removed", name)
            for name, entry in wanted.items():
                served = router.models.get(name)
                if served is not None and served.path != entry.path:
                    if router.has_requests(name):      # switched once they finish
                        pending = True
                    else:
                        router.remove_model(name)      # re-imported: serve the new files
                        self._templates.pop(name, None)
                elif (served is not None and served.state == ModelState.FAILED
                      and seen.get(name) != entry):
                    served = router.reopen(name)
                    note = f": {served.error}" if served.error else ""
                    log.info("model %s opened again (%s%s)", name, served.state.value, note)
                if name not in router.models:
                    router.add_model(name, entry.path, entry.settings)
                    self.created[name] = _unix(entry.added)
                    log.info("model %s added (%s)", name, router.models[name].state.value)
                elif router.models[name].settings != entry.settings:
                    try:
                        router.configure(name, entry.settings)
                        log.info("model %s settings: %s", name, entry.settings)
                    except MoxError as e:
                        log.error("model %s keeps its settings: %s", name, e)
            self.switch_pending = pending

        self.async_engine.call(apply)

    def shutdown(self) -> None:
        self.async_engine.shutdown()
        self.router.shutdown()


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    home: str | None = None
    demo: bool = False
    api_key: str | None = None
    router: RouterConfig = RouterConfig()
    limits: ServerLimits = ServerLimits()


def _unix(iso: str) -> int:
    """The registry's ISO-8601 `added` as unix seconds (now, if unreadable)."""
    try:
        return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return int(time.time())


def in_registration_order(entries: list[ModelEntry]) -> list[ModelEntry]:
    """The registry lists models by name; they are served in the order they were added, so
    where the budget cannot hold them all, the one refused is the last added, at start as
    when added live (it had been the last by name, and a restart could fail another)."""
    return sorted(entries, key=lambda e: (e.added, e.name))


def registered_models(options: ServeOptions) -> Registry:
    registry = Registry(options.home)
    if options.demo:
        from mox.demo import ensure_demo_models

        known = {e.name for e in registry.list()}
        for name, path in ensure_demo_models(registry.home).items():
            if name not in known:
                registry.add(name, path)
    return registry


@dataclass
class Serving:
    """One running mox: the router behind its HTTP server, following the registry."""

    backend: RouterBackend
    runner: web.AppRunner
    port: int
    entries: list[ModelEntry]
    watcher: asyncio.Task

    async def stop(self) -> None:
        """Stop accepting; in-flight requests get the shutdown grace; then the engine stops."""
        self.watcher.cancel()
        await stop_server(self.runner)
        self.backend.shutdown()


async def start_serving(options: ServeOptions) -> Serving:
    """The registry's models behind the router, on options.host:options.port (0: any free
    port), following the registry. `mox serve` runs one; so does each Ray replica."""
    registry = registered_models(options)
    entries = in_registration_order(registry.list())
    router = Router({e.name: e.path for e in entries}, options.router,
                    settings={e.name: e.settings for e in entries})
    backend = RouterBackend(router, entries)
    app = create_app(backend, api_key=options.api_key, limits=options.limits)
    runner, port = await start_server(app, options.host, options.port)
    watcher = asyncio.create_task(_watch_registry(registry, backend))
    return Serving(backend, runner, port, entries, watcher)


async def serve(options: ServeOptions, ready: asyncio.Event | None = None) -> int:
    serving = await start_serving(options)
    router = serving.backend.router
    for entry in serving.entries:
        served = router.models[entry.name]
        note = f": {served.error}" if served.error else ""
        print(f"mox: {entry.name} {served.state.value}{note}", file=sys.stderr)
    print(f"mox: serving {len(serving.entries)} models on http://{options.host}:"
          f"{serving.port}/v1 (policy {options.router.policy})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    print("mox: stopping: finishing in-flight requests", file=sys.stderr, flush=True)
    await serving.stop()
    return 0


async def _watch_registry(registry: Registry, backend: RouterBackend) -> None:
    seen = registry.version()
    while True:
        await asyncio.sleep(REGISTRY_CHECK_S)
        version = registry.version()
        if version != seen or backend.switch_pending:
            seen = version
            try:
                backend.follow_registry(in_registration_order(registry.list()))
            except MoxError as e:        # a damaged registry: the models keep serving
                log.error("registry not reloaded, serving the models as they were: %s", e)
            except Exception:  # noqa: BLE001 - a bug here must not stop serving
                log.exception("could not reload %s", registry.path)
