"""The I/O threads: calls (a read, or a load that reads and commits) taken from a priority
queue. Demand calls (a step waits on them) overtake queued prefetches; a queued call can be
cancelled through its Future, or promoted to demand priority once a step needs what it reads
(a cold start's read-ahead, queued behind other models' read-aheads, that a decode step now
waits on)."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .threads import use_one_thread

T = TypeVar("T")
DEMAND, PREFETCH = 0, 1           # I/O priorities: a step waiting on a read goes first
_STOP = 99                        # sorts after every real task: queued work finishes first


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    future: Future
    claimed: bool = False         # a thread took it (a promoted call is queued twice)


@dataclass(order=True)
class _Task:
    priority: int
    seq: int
    call: _Call | None = field(compare=False)


class IOPool:
    """Worker threads taking calls from a priority queue, first by priority, then in order."""

    def __init__(self, num_threads: int) -> None:
        self._queue: queue.PriorityQueue[_Task] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._unfinished = 0                          # queue entries not yet dropped or run
        self._low: dict[Future, _Call] = {}           # queued below demand priority
        self._threads = [threading.Thread(target=self._work, name=f"mox-io-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: object, priority: int = DEMAND) -> Future:
        call = _Call(fn, args, Future())
        with self._lock:
            self._unfinished += 1
            if priority > DEMAND:
                self._low[call.future] = call
        self._queue.put(_Task(priority, next(self._seq), call))
        return call.future

    def promote(self, future: Future) -> bool:
        """Queue a call submitted below demand priority once more, at demand priority, if no
        thread has taken it yet (the first copy a thread takes runs it; the other is dropped).
        Returns whether it was promoted."""
        with self._lock:
            call = self._low.pop(future, None)
            if call is None or call.claimed:
                return False
            self._unfinished += 1
        self._queue.put(_Task(DEMAND, next(self._seq), call))
        return True

    def num_queued(self) -> int:
        """Calls waiting for a thread (approximate: others may take some meanwhile)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        """Whether any call is queued or running (a cancelled one counts until a thread
        drops it)."""
        return self._unfinished > 0

    def _claim(self, call: _Call) -> bool:
        with self._lock:
            if call.claimed:
                return False                          # its other copy ran
            call.claimed = True
            self._low.pop(call.future, None)
        return call.future.set_running_or_notify_cancel()    # False: cancelled while queued

    def _work(self) -> None:
        use_one_thread()                    # see loaders/threads.py
        while (task := self._queue.get()).call is not None:
            call, task = task.call, None
            try:
                if not self._claim(call):
                    continue
                try:
                    call.future.set_result(call.fn(*call.args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    call.future.set_exception(e)
            finally:
                # an idle thread holds nothing of its last call: its arguments (a model's
                # slot pool, by way of a bound load) stayed alive while the thread waited
                call = None
                with self._lock:
                    self._unfinished -= 1

    def stop(self) -> None:
        """Let the threads end once the queued calls are done, without waiting for them."""
        for _ in self._threads:
            self._queue.put(_Task(_STOP, next(self._seq), None))

    def shutdown(self) -> None:
        self.stop()
        for thread in self._threads:
            thread.join()
