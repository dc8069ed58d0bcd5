"""The I/O threads' queue (loaders/io_pool.py): priorities, cancelling, promotion."""

import gc
import threading
import time
import weakref

from mox.loaders.io_pool import DEMAND, PREFETCH, IOPool
from mox.loaders.stream import StreamingReader


def _blocked_pool():
    """One thread, held by a call until the returned event is set."""
    pool, release = IOPool(1), threading.Event()
    started = threading.Event()
    pool.submit(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return pool, release


def test_demand_calls_overtake_queued_prefetches_and_a_promoted_one_joins_them():
    pool, release = _blocked_pool()
    order = []
    try:
        low = [pool.submit(order.append, f"low{i}", priority=PREFETCH) for i in range(3)]
        pool.submit(order.append, "demand", priority=DEMAND)
        assert pool.promote(low[2])                 # a step now waits on it
        assert not pool.promote(low[2])             # once is enough
        release.set()
        for f in low:
            f.result(timeout=10)
        assert order == ["demand", "low2", "low0", "low1"]     # then by submission
    finally:
        release.set()
        pool.shutdown()
    assert not pool.busy                            # both copies of the promoted call counted


def test_a_promoted_call_runs_once_and_a_running_or_demand_call_is_not_promoted():
    pool, release = _blocked_pool()
    runs = []
    try:
        demand = pool.submit(runs.append, "d")
        low = pool.submit(runs.append, "p", priority=PREFETCH)
        assert not pool.promote(demand)             # already at demand priority
        assert pool.promote(low)
        release.set()
        low.result(timeout=10)
        demand.result(timeout=10)
        assert sorted(runs) == ["d", "p"]           # the promoted call ran once
        assert not pool.promote(low)                # done: nothing to promote
    finally:
        release.set()
        pool.shutdown()


def test_a_cancelled_call_stays_cancelled_when_promoted():
    pool, release = _blocked_pool()
    ran = []
    try:
        low = pool.submit(ran.append, "x", priority=PREFETCH)
        assert low.cancel()
        pool.promote(low)
        release.set()
        pool.submit(lambda: None).result(timeout=10)
        assert low.cancelled() and ran == []
    finally:
        release.set()
        pool.shutdown()
    assert not pool.busy


class _Arguments:
    """Stands in for what a load holds (a model's slot pool)."""


def test_an_idle_thread_holds_nothing_of_its_last_call():
    pool, arguments = IOPool(1), _Arguments()
    try:
        held = weakref.ref(arguments)
        pool.submit(lambda a: None, arguments).result(timeout=10)
        del arguments
        deadline = time.monotonic() + 10
        while held() is not None and time.monotonic() < deadline:   # the thread's finally
            gc.collect()
            time.sleep(0.01)
        assert held() is None
    finally:
        pool.shutdown()


def test_a_reader_dropped_unclosed_stops_its_threads():
    reader = StreamingReader(num_threads=2)
    threads = list(reader._pool._threads)
    del reader
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
