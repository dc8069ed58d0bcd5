"""GB/s that one native MoE-kernel call reads from one expert, per weight format, at a given
expert shape, row count and thread count: calls cycle over more experts than the last-level
cache holds, so every call reads its expert from memory. Each pass times every format in
turn (the same moment for all), and prints each pass's figure. With `--base REV`, the kernels
built from that revision's sources take turns with the working tree's, pass by pass (this
VM's read rate drifts 30-50% between runs; alternation measures a kernel change at one
moment), and each format's new / base ratio of medians is printed.

    .venv/bin/python -m mox.bench.micro.expert_rate [--hidden 1024] [--inter 3584]
        [--rows 1] [--threads 2] [--passes 5] [--base REV] [--base-flags=FLAGS]

(`--inter 3584`: the experts preset's experts, 22 MiB in bf16; the bench preset's are 512.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from mox.bench.machine import past_the_cache
from mox.bench.micro.native_ab import base_build
from mox.bench.micro.quant_kernels import quantized_pool
from mox.kernels import native, native_build
from mox.kernels.quant import FP8_BLOCK128, INT4_GROUP128, INT8_PER_CHANNEL

POOL_BYTES = past_the_cache(512 << 20)   # bf16 experts in the pool: past the last-level cache
CALLS = 48


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3584)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--base", help="git revision whose kernels take turns with the tree's")
    ap.add_argument("--base-flags", default=" ".join(native_build.TARGET_FLAGS),
                    help="the base build's target flags (default: the tree's, %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden, inter = args.hidden, args.inter
    experts = max(4, POOL_BYTES // (6 * hidden * inter))
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16()
    pools = {"bf16": (w13, w2, None), "int8": quantized_pool(w13, w2, INT8_PER_CHANNEL),
             "int4": quantized_pool(w13, w2, INT4_GROUP128),
             "fp8": quantized_pool(w13, w2, FP8_BLOCK128)}
    with tempfile.TemporaryDirectory() as folder:
        paths = {"new": native_build.build(native.SOURCE_DIR)}
        if args.base:
            paths["base"] = base_build(args.base, args.base_flags, folder)
        if None in paths.values():
            raise SystemExit("the native kernels could not be built here")
        builds = {tag: native.NativeKernels(path) for tag, path in paths.items()}
        rates = measure(builds, pools, args.rows, experts, args.passes)
    print(f"H {hidden}, I {inter}, {args.rows} rows, {args.threads} threads, {experts} experts")
    for (tag, name), values in rates.items():
        print(f"{name} {tag}: GB/s " + " / ".join(f"{v:.1f}" for v in values))
    if args.base:
        for name in pools:
            ratio = statistics.median(rates["new", name]) / statistics.median(rates["base", name])
            print(f"{name}: new / base {ratio:.2f}x")


def measure(builds: dict[str, native.NativeKernels], pools: dict, rows: int, experts: int,
            passes: int) -> dict[tuple[str, str], list[float]]:
    """GB/s per (build, format) and pass: in each pass every build times every format."""
    x = torch.randn(rows, pools["bf16"][0].shape[2]).bfloat16()
    inter = pools["bf16"][1].shape[2]
    scratch = [torch.empty(rows, 2 * inter), torch.empty(rows, inter, dtype=torch.bfloat16),
               torch.empty(rows, x.shape[1])]
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(passes):
        for tag, lib in builds.items():
            for name, (a, b, scales) in pools.items():
                nbytes = sum(t[0].numel() * t.element_size()          # weights and scales
                             for t in (a, b, *((scales.w13, scales.w2) if scales else ())))
                start = time.perf_counter()
                for call in range(CALLS):
                    lib.moe_experts(x, a, b, [((call * 7) % experts, rows)], torch.ones(rows),
                                    scratch, scales=scales)
                rates.setdefault((tag, name), []).append(
                    nbytes * CALLS / (time.perf_counter() - start) / 1e9)
    return rates


if __name__ == "__main__":
    main()
