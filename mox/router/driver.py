"""The async face of the router: `generate()` yields incremental outputs to asyncio code while
the step loop runs on its own thread, so the event loop never waits on a forward pass.

The loop drives a `Driver` (the router, which drives the engine). Both are single-threaded:
requests and aborts reach them through an inbox that the loop thread drains between steps,
and outputs go back through each request's asyncio queue (`call_soon_threadsafe`). A
cancelled or abandoned iterator aborts its request, which frees its KV (and, between steps,
it holds no expert leases). With nothing to run, the loop sleeps on the driver's `wake`
event, at most until the driver's next timed duty.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from mox.errors import InvalidRequestError
from mox.messages import Request, RequestOutput
from mox.router.timeline import Watchdog

log = logging.getLogger(__name__)


class Driver(Protocol):
    wake: threading.Event            # set from any thread when a step became useful
    outside_waiting: Callable[[], bool]   # set by the loop: whether its inbox holds work

    @property
    def has_work(self) -> bool: ...
    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> RequestOutput | None: ...
    def step(self) -> list[RequestOutput]: ...
    def seconds_until_due(self) -> float | None: ...
    def take_error(self, request_id: str) -> BaseException | None: ...
    def step_in_progress(self) -> tuple[float, str] | None: ...


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = driver.wake
        # (a list's truth is one read: no lock; a run of decode steps asks after each step)
        driver.outside_waiting = lambda: bool(self._inbox)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mox-engine", daemon=True)
        self._thread.start()
        self.watchdog = Watchdog(driver.step_in_progress)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request.request_id in self._streams:      # it would take the other's outputs
                raise InvalidRequestError(f"request id {request.request_id!r} is already "
                                          "running")
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
        self._submit(lambda: self.deliver([o for o in [self.driver.abort(request_id)] if o]))

    def abort_all(self, error: Exception) -> None:
        """End every request, each stream raising `error` (shutdown past its grace)."""
        self._submit(lambda: self._fail_all(error))

    def call(self, fn: Callable[[Driver], object]) -> None:
        """Run `fn(driver)` on the engine thread between steps (inspection, admin)."""
        self._submit(lambda: fn(self.driver))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join()
        self.watchdog.stop()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(command)
        self._wake.set()

    def _add(self, request: Request) -> None:
        try:
            self.driver.add_request(request)
        except Exception as e:  # noqa: BLE001 - the caller's iterator raises it
            self._deliver_one(request.request_id, e)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()           # before looking for work: a later set is not lost
            with self._lock:
                commands, self._inbox = self._inbox, []
            for command in commands:
                try:
                    command()
                except Exception:  # noqa: BLE001 - an admin call's bug must not stop serving
                    log.exception("engine command failed")
            try:
                self.deliver(self.driver.step())
            except Exception as e:  # noqa: BLE001 - a bug must not hang every client
                self._fail_all(e)
            if not self.driver.has_work:
                self._wake.wait(self.driver.seconds_until_due())

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.driver.abort(request_id)
            self._deliver_one(request_id, error)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs go to their streams; a request that ended in an error (its model failed,
        it timed out in the queue) raises that error from its iterator instead."""
        for out in outputs:
            error = self.driver.take_error(out.request_id) if out.error is not None else None
            self._deliver_one(out.request_id, out if error is None else error)

    def _deliver_one(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
