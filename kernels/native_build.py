"""Building the native CPU kernels: one shared library of every C file in `csrc/`, compiled
with the system C compiler into a per-user cache, keyed by the sources' hash (mox.kernels.native
loads it)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile

log = logging.getLogger("mox.kernels")

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
COMPILE_TIMEOUT_S = 120


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mox", "native")


def build(source_dir: str, defines: tuple[str, ...] = ()) -> str | None:
    """One shared library of every C file in `source_dir`, compiled once per hash of the
    folder's sources and headers and the macros `defines` (e.g. "MOX_TIMELINE": csrc/
    timeline.h) (None: no compiler, or no writable cache)."""
    files = sorted(os.path.join(source_dir, f) for f in os.listdir(source_dir)
                   if f.endswith((".c", ".h")))
    sources = [f for f in files if f.endswith(".c")]
    digest = hashlib.sha256(" ".join(defines).encode())
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
    command = [os.environ.get("CC", "cc"), "-O3", "-ffp-contract=off", "-fopenmp", "-shared",
               "-fPIC", *(f"-D{name}" for name in defines), *sources,
               "-o", staged, "-lm"]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.info("native CPU kernels unavailable (%s): %s", " ".join(command),
                 detail.decode(errors="replace")[-300:] or e)
        os.unlink(staged)
        return None
    os.replace(staged, target)             # atomic: a concurrent build wrote the same bytes
    return target
