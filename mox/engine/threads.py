"""Intra-op threads of torch on the CPU for the threads that run model steps.

I/O and loader threads run torch with one intra-op thread (loaders/threads.py). But with
torch's OpenMP backend a worker's `torch.set_num_threads(1)` also lowers the count of every
thread that never set its own (measured: the engine and the offline `LLM` caller fell to one
thread, and their matmuls ran 2x slower). So the engine pins its own count on every step: what
the process had when this module was imported (the router and the offline `LLM` import the
engine before any pager exists, so before any I/O thread has run), or the count it is given
(`mox serve --compute-threads`).

Unless given a count, the engine also leaves the cores other processes are using: an OpenMP
team waits at every barrier for its slowest member, so a team of 2 on 2 cores beside one busy
process ran 2.5x slower than a team of 1 (rounds of 150 streams, p50 14.0 s vs 5.7 s; 4.4 s
with no neighbour; bench/results/stream_rounds.md). `SharedCores` reads the machine's busy
time from /proc/stat every few seconds and subtracts this process's own. The engine takes one
thread fewer still while the pager's reads are in flight (`Engine._threads`): its own I/O
threads want a core then.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

COMPUTE_THREADS = torch.get_num_threads()
# How often the neighbours' load is re-read: a few steps' worth, so a burst next door is
# followed within seconds and /proc is read rarely.
SHARED_CORES_PERIOD_S = 2.0
# A neighbour using less than this share of a core leaves the core to us.
NEIGHBOUR_CORE_THRESHOLD = 0.5


def use_compute_threads(count: int = COMPUTE_THREADS) -> None:
    """For threads that run model steps; cheap enough to call every step."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


class SharedCores:
    """The compute thread count to use now: `max_threads` less the cores other processes (or
    the host) kept busy over the last period, at least one; the CPUs counted are the ones this
    process may run on. Without /proc (not Linux): `max_threads`."""

    def __init__(self, max_threads: int = COMPUTE_THREADS,
                 period_s: float = SHARED_CORES_PERIOD_S) -> None:
        self.max_threads, self.period_s = max_threads, period_s
        self.threads = max_threads
        self._last = cpu_times()
        self._last_at = time.monotonic()

    def current(self) -> int:
        now = time.monotonic()
        if self._last is None or now - self._last_at < self.period_s:
            return self.threads
        sample = cpu_times()
        if sample is None:                 # /proc went away: keep the last answer
            return self.threads
        busy = (sample.busy - self._last.busy) - (sample.process - self._last.process)
        neighbours = busy / (now - self._last_at)              # cores others used
        taken = int(neighbours + 1.0 - NEIGHBOUR_CORE_THRESHOLD)
        self.threads = max(1, self.max_threads - taken)
        self._last, self._last_at = sample, now
        return self.threads


def usable_cores() -> int:
    """The CPUs this process may run on (all of them where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                 # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds so far: busy time of the CPUs this process may run on (time the host stole
    included: those cores were not ours either), the stolen part alone, and one process's."""

    busy: float
    steal: float
    process: float


def cpu_times(pid: int | str = "self") -> CpuTimes | None:
    """From /proc (None where there is none): what `SharedCores` and the benchmarks use."""
    try:
        allowed = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, AttributeError):      # no /proc, or no sched_getaffinity (not Linux)
        return None
    busy = steal = 0
    for row in rows:
        if row[0] in allowed:
            user, nice, system, _idle, _iowait, irq, softirq, stolen = map(int, row[1:9])
            busy += user + nice + system + irq + softirq + stolen
            steal += stolen
    ticks = os.sysconf("SC_CLK_TCK")
    return CpuTimes(busy / ticks, steal / ticks, (int(fields[11]) + int(fields[12])) / ticks)
