"""The async face of the engine: `generate()` yields incremental outputs to asyncio code while
the model loop runs on its own thread, so the event loop never waits on a forward pass.

The engine itself is single-threaded: requests and aborts reach it through an inbox that the
loop thread drains between steps, and outputs go back through each request's asyncio queue
(`call_soon_threadsafe`). A cancelled or abandoned iterator aborts its request, which frees
its KV (and, between steps, it holds no expert leases).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mox.engine.engine import Engine
from mox.engine.sequence import Request, RequestOutput


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mox-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request.request_id] = stream
        self._submit(lambda: self._add(request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)
            with self._lock:
                self._streams.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._deliver([o for o in [self.engine.abort(request_id)] if o]))

    def call(self, fn: Callable[[Engine], object]) -> None:
        """Run `fn(engine)` on the engine thread between steps (inspection, admin)."""
        self._submit(lambda: fn(self.engine))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(command)
        self._wake.set()

    def _add(self, request: Request) -> None:
        try:
            self.engine.add_request(request)
        except Exception as e:  # noqa: BLE001 - the caller's iterator raises it
            self._deliver_one(request.request_id, e)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                commands, self._inbox = self._inbox, []
            for command in commands:
                command()
            if self.engine.has_work:
                try:
                    self._deliver(self.engine.step())
                except Exception as e:  # noqa: BLE001 - a bug must not hang every client
                    self._fail_all(e)
            else:
                self._wake.wait()
                self._wake.clear()

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._deliver_one(request_id, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver_one(out.request_id, out)

    def _deliver_one(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
