"""Building the native CPU kernels: one shared library of every C file in `csrc/`, compiled
with the system C compiler into a per-user cache, keyed by the sources' hash and the CPU
(mox.kernels.native loads it).

The library is built on the machine that loads it, so it is compiled for that CPU
(`-march=native`, as llama.cpp builds by default): the kernels' hot loops pick their vector
path at run time either way, but the scalar loops between them (norms, bf16 conversions,
residual adds, the experts' combine) are then vectorized by the compiler with the CPU's widest
instructions. That is exact (no reassociation without -ffast-math, no contraction with
-ffp-contract=off), and at 32 sequences it took about 0.6 ms off a 41-48 ms bench decode
step (bench/results/chain_timeline-4.md to -7.md, alternated). The ISA, not the tuning:
`-mtune=generic` keeps GCC from tuning for the CPU, which on an AMD EPYC Zen 3 (AVX2) folded
the AVX2 tiles' activation loads into their FMAs (three times the loads a step of 16 weights)
and ran the GEMVs at 0.6-0.9x from four x rows on; with generic tuning the GEMVs read
1.08-1.72x faster at 4-32 rows, the same at 1-2, and a 32-sequence decode step took 0.81x
the time (bench/results/native_ab_tune-{1,2}.md, step_ab-mtune-generic-1.md). A compiler
that rejects the flags builds without them."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile

log = logging.getLogger("mox.kernels")

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
COMPILE_TIMEOUT_S = 120
TARGET_FLAGS = ("-march=native", "-mtune=generic")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mox", "native")


def _cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (Linux), else
    the platform's name for it. A cache shared by machines with different CPUs (a home
    folder on NFS) then holds one library per CPU rather than one that faults on another."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]                  # the first processor's
        fields = {key.strip(): value.strip() for key, _, value in
                  (line.partition(":") for line in first.splitlines())}
        return fields.get("model name", "") + " " + fields.get("flags", "")
    except OSError:
        return platform.machine() + " " + platform.processor()


def build(source_dir: str, defines: tuple[str, ...] = (),
          target_flags: tuple[str, ...] = TARGET_FLAGS) -> str | None:
    """One shared library of every C file in `source_dir`, compiled once per hash of the
    folder's sources and headers, the macros `defines` (e.g. "MOX_TIMELINE": csrc/
    timeline.h), the target flags (bench/micro/native_ab.py compares them) and the CPU
    (None: no compiler, or no writable cache)."""
    files = sorted(os.path.join(source_dir, f) for f in os.listdir(source_dir)
                   if f.endswith((".c", ".h")))
    sources = [f for f in files if f.endswith(".c")]
    digest = hashlib.sha256(" ".join((*defines, *target_flags, _cpu_identity())).encode())
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    folder = _cache_dir()
    target = os.path.join(folder, f"mox_cpu-{digest.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    try:
        os.makedirs(folder, exist_ok=True)
        fd, staged = tempfile.mkstemp(suffix=".so", dir=folder)
    except OSError as e:                  # no writable cache: serve with torch's paths
        log.info("native CPU kernels unavailable: cannot write %s: %s", folder, e)
        return None
    os.close(fd)
    # (no FMA contraction: rope_kv.c must round as torch's separate multiply and add do)
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
             *(f"-D{name}" for name in defines)]
    # for this CPU; else what any compiler takes
    if not any(_compile([*flags, *march, *sources, "-o", staged, "-lm"])
               for march in (target_flags, ())):
        os.unlink(staged)
        return None
    os.replace(staged, target)             # atomic: a concurrent build wrote the same bytes
    return target


def _compile(arguments: list[str]) -> bool:
    command = [os.environ.get("CC", "cc"), *arguments]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.info("native CPU kernels: %s failed: %s", " ".join(command),
                 detail.decode(errors="replace")[-300:] or e)
        return False
