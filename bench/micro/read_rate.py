"""How fast this machine reads weights that do not fit in cache, per candidate kernel: the
floor of a CPU decode step is (bytes it touches) / (the best of these rates).

Weights: many distinct bf16 matrices cycled (together far past the L3), so every call reads
from memory, in the bench olmoe's shapes: an expert's gate+up `[2I, H]` (2 MiB) and down
`[H, I]` (1 MiB), attention's `[H, H]`, and a 64 MiB lm_head. Per candidate and number of
rows M (sequences in a decode step): GB/s of weight read, best of a few passes.

- `read`: a plain read of the bytes (`tensor.sum()` in float32 is not that: it converts;
  the yardstick is a bf16 `torch.max` over the buffer, a reduction that only reads);
- `torch.mv` (M = 1), `F.linear` / `torch.mm` (torch's GEMM for M rows);
- `mkldnn packed`: oneDNN's linear with the weight reordered once ahead (what torch.compile's
  freezing uses on CPU); it needs a second, opaque copy of each weight, so the pager cannot
  read experts into it in place;
- `native`: mox's AVX512-BF16 or AVX2 kernel (kernels/csrc/bf16_gemv.c), weights read in place.

    .venv/bin/python -m mox.bench.micro.read_rate [--rows 1,2,4,8,32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mox.bench.machine import describe, past_the_cache
from mox.kernels import native

RESULTS_DIR = Path(__file__).parent.parent / "results"
POOL_BYTES = past_the_cache(512 << 20)   # cycled matrices: past the last-level cache
SHAPES = {"expert gate+up [1024, 1024]": (1024, 1024), "expert down [1024, 512]": (1024, 512),
          "lm_head [32000, 1024]": (32000, 1024)}
PASSES = 3


def _pool(n: int, k: int) -> torch.Tensor:
    count = max(2, POOL_BYTES // (n * k * 2))
    return torch.randn(count, n, k).to(torch.bfloat16)


def _rate(pool: torch.Tensor, call: Callable[[torch.Tensor], object]) -> float:
    """Best GB/s of weight read over PASSES passes through the pool."""
    call(pool[0])
    best = 0.0
    for _ in range(PASSES):
        start = time.perf_counter()
        for w in pool:
            call(w)
        best = max(best, pool.numel() * 2 / (time.perf_counter() - start) / 1e9)
    return best


def candidates(rows: int, k: int, packed: dict | None) -> dict[str, Callable]:
    """Each kernel as `call(weight)`, its activations `[rows, k]` made once (not per call)."""
    x = torch.randn(rows, k).to(torch.bfloat16)
    kernels = native.kernels()
    out = {"F.linear": lambda w: F.linear(x, w)}
    if packed is not None:
        out["mkldnn packed"] = lambda w: torch.ops.mkldnn._linear_pointwise(
            x, packed[w.data_ptr()], None, "none", [], "")
    if rows == 1:
        out["torch.mv"] = lambda w: torch.mv(w, x[0])
        out["read (torch.max)"] = lambda w: torch.max(w)
    if kernels is not None and kernels.fast and rows <= native.MAX_ROWS[kernels.isa]:
        out["native"] = lambda w: kernels.gemv(x, w)
    return out


def measure(rows_list: list[int]) -> dict:
    results = {}
    for shape_name, (n, k) in SHAPES.items():
        pool = _pool(n, k)
        try:
            packed = {w.data_ptr(): torch.ops.mkldnn._reorder_linear_weight(w, None)
                      for w in pool}
        except RuntimeError:            # oneDNN packs bf16 only with AVX-512 (or AVX-NE-CONVERT)
            packed = None
        for rows in rows_list:
            for name, call in candidates(rows, k, packed).items():
                rate = _rate(pool, call)
                results.setdefault(shape_name, {}).setdefault(name, {})[rows] = round(rate, 1)
                print(f"{shape_name} M={rows} {name}: {rate:.1f} GB/s", flush=True)
        del pool, packed
    return results


def write(results: dict, rows_list: list[int], argv: list[str], name: str) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    meta = {"command": " ".join([".venv/bin/python -m mox.bench.micro.read_rate", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_head": head, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": describe(),
            "uptime": os.getloadavg()}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({**meta, "gbps": results}, indent=1))
    lines = ["# Weight read rate per kernel (bf16, CPU, weights cycled past the cache)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "GB/s of weight read; M = rows of activations (sequences in a decode step).", ""]
    for shape_name, per_kernel in results.items():
        lines += [f"## {shape_name}", "", "| kernel | " + " | ".join(
            f"M={m}" for m in rows_list) + " |", "|---|" + "---|" * len(rows_list)]
        lines += [f"| {name} | " + " | ".join(str(rates.get(m, "-")) for m in rows_list) + " |"
                  for name, rates in per_kernel.items()]
        lines.append("")
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,32")
    ap.add_argument("--name", default="read_rate",
                    help="results as bench/results/NAME.json and NAME.md")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        results = measure(rows_list)
    write(results, rows_list, sys.argv[1:], args.name)


if __name__ == "__main__":
    main()
