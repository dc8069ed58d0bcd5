"""The machine a benchmark ran on, in one line for its report: runs on different CPUs are not
comparable (the native kernels take AVX512-BF16, AVX2 or plain-C paths by what the CPU has),
so every report names the CPU and the path."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (sysfs), 0 if it reports none. Hosts differ by 10x:
    32 MiB on the EPYC VMs of earlier sessions, 480 MiB on a Xeon with AMX."""
    sizes = [0]
    folder = "/sys/devices/system/cpu/cpu0/cache"
    for index in os.listdir(folder) if os.path.isdir(folder) else ():
        try:
            with open(os.path.join(folder, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def past_the_cache(nbytes: int) -> int:
    """`nbytes`, or twice the last-level cache where that is more: data cycled through it is
    read from memory, not from the cache, on every pass."""
    return max(nbytes, 2 * last_level_cache_bytes())


def describe() -> str:
    """e.g. "x86_64, AMD EPYC, 2 CPUs, Linux, native kernels: avx2"."""
    from mox.kernels import native

    kernels = native.kernels()
    path = "off" if kernels is None else kernels.isa + ("+amx" if kernels.amx else "")
    cache = last_level_cache_bytes() >> 20
    return (f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()}, "
            f"last-level cache {cache} MiB, native kernels: {path}")
