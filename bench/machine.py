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


def describe() -> str:
    """e.g. "x86_64, AMD EPYC, 2 CPUs, Linux, native kernels: avx2"."""
    from mox.kernels import native

    kernels = native.kernels()
    path = "off" if kernels is None else kernels.isa + ("+amx" if kernels.amx else "")
    return (f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs, {platform.system()}, "
            f"native kernels: {path}")
