"""A/B of two builds of the native CPU kernels in one run: the sources of a git revision
(`--base`, default HEAD) against the working tree's, alternated pass by pass on the same
data, so a kernel change is measured against what it replaces on this machine at the same
moment (this VM's memory rate drifts 30-50% between runs).

- `gemv`: the decode GEMV (kernels/csrc/bf16_gemv.c) on the bench olmoe's dense shapes,
  weights cycled past the last-level cache (every call reads from memory), M rows of
  activations;
- `moe`: one MoE layer's experts (kernels/csrc/moe_experts.c) over 64-slot pools of the bench
  olmoe's experts (H 1024, I 512), each call routing T tokens to 4 experts at random (its
  top-k: 32 tokens give ~2.3 rows an active expert, as in a 32-sequence decode step; 64 and
  128, ~4 and ~8: where AMX tiles take an expert's rows); as many layers' pools as take the
  experts past the last-level cache, one after another call by call;
- `attention`: decode attention (kernels/csrc/decode_attention.c) with the bench olmoe's heads
  (16 query, 4 KV, 64 dims), T tokens over L cached keys each, in blocks of 16 slots
  scattered over the store (as the engine's KV pool hands them out).

Figures: GB/s of weights (or keys and values) read, median of the alternated passes, and
new / base.

    .venv/bin/python -m mox.bench.micro.native_ab [--base REV] [--name NAME]
        [--parts gemv,moe,attention]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from mox.bench.machine import describe, past_the_cache
from mox.kernels import native, native_build

RESULTS_DIR = Path(__file__).parent.parent / "results"
# the GEMV's matrices together, and the MoE layers' pools: past the last-level cache
CYCLED_BYTES = past_the_cache(256 << 20)
GEMV_SHAPES = {"gate+up [1024, 1024]": (1024, 1024), "attention qkv [3072, 1024]": (3072, 1024),
               "lm_head [32000, 1024]": (32000, 1024)}
GEMV_ROWS = (1, 2, 4, 8, 16, 32)
MOE_TOKENS = (1, 8, 16, 32, 64, 128)
HIDDEN, INTER, SLOTS, TOP_K = 1024, 512, 64, 4
PASSES = 6                      # an even number: as many A B turns as B A
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 64
ATTENTION_SHAPES = ((1, 48), (32, 48), (1, 2048), (8, 2048), (32, 512))   # (tokens, keys)
KV_BLOCK = 16                 # mox.engine's KV block size


def base_sources(rev: str, folder: str) -> str:
    """kernels/csrc as of `rev`, written under `folder`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/csrc"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:kernels/csrc/{name}"], check=True,
                              capture_output=True).stdout
        Path(folder, name).write_bytes(blob)
    return folder


def base_build(revision: str, flags: str, folder: str) -> str | None:
    """The library of `revision`'s sources, built with the target flags `flags` (the
    `--base-flags` of the A/Bs)."""
    return native_build.build(base_sources(revision, folder), target_flags=tuple(flags.split()))


def alternate(builds: dict[str, native.NativeKernels],
              one_pass: Callable[[native.NativeKernels], int]) -> dict[str, float]:
    """Median GB/s per build, the builds taking turns pass by pass, A B then B A: in an A/A
    test of the MoE experts beside a read-rate probe, the build that ran first after the probe
    read 3-10% slower, every pass."""
    rates: dict[str, list[float]] = {tag: [] for tag in builds}
    for i in range(PASSES):
        for tag, lib in list(builds.items())[::1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            nbytes = one_pass(lib)
            rates[tag].append(nbytes / (time.perf_counter() - start) / 1e9)
    return {tag: statistics.median(r) for tag, r in rates.items()}


def _gemv_pass(x: torch.Tensor, weights: list[torch.Tensor], lib: native.NativeKernels) -> int:
    for w in weights:
        lib.gemv(x, w)
    return sum(w.numel() * w.element_size() for w in weights)


def _moe_pass(calls: list, pools: list[tuple[torch.Tensor, torch.Tensor]],
              lib: native.NativeKernels) -> int:
    for i, (runs, rows, weights, scratch) in enumerate(calls):
        w13, w2 = pools[i % len(pools)]            # a layer after another, as a step reads
        lib.moe_experts(rows, w13, w2, runs, weights, scratch)
    w13, w2 = pools[0]
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return sum(len(runs) for runs, *_ in calls) * expert_bytes


def gemv_rows(builds: dict[str, native.NativeKernels]) -> list[str]:
    lines = ["| GEMV | " + " | ".join(f"M={m}" for m in GEMV_ROWS) + " |",
             "|---|" + "---|" * len(GEMV_ROWS)]
    for name, (n, k) in GEMV_SHAPES.items():
        weights = [torch.randn(n, k).bfloat16()
                   for _ in range(max(2, CYCLED_BYTES // (n * k * 2)))]
        cells = []
        for m in GEMV_ROWS:
            r = alternate(builds, partial(_gemv_pass, torch.randn(m, k).bfloat16(), weights))
            cells.append(f"{r['base']:.1f} -> {r['new']:.1f} ({r['new'] / r['base']:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def routed_call(tokens: int, generator: torch.Generator) -> tuple:
    """One MoE layer call's arguments over the bench olmoe's experts: `tokens` tokens routed
    to TOP_K of SLOTS slots each at random, as (runs, rows, routing weights, scratch)."""
    ids = torch.stack([torch.randperm(SLOTS, generator=generator)[:TOP_K]
                       for _ in range(tokens)]).flatten()
    slots, counts = torch.unique(ids, return_counts=True)
    num_rows = tokens * TOP_K
    return (list(zip(slots.tolist(), counts.tolist())), torch.randn(num_rows, HIDDEN).bfloat16(),
            torch.ones(num_rows), [torch.empty(num_rows, 2 * INTER),
                                   torch.empty(num_rows, INTER, dtype=torch.bfloat16),
                                   torch.empty(num_rows, HIDDEN)])


def moe_rows(builds: dict[str, native.NativeKernels]) -> list[str]:
    pool_bytes = SLOTS * 3 * HIDDEN * INTER * 2
    pools = [((torch.randn(SLOTS, 2 * INTER, HIDDEN) * 0.05).bfloat16(),
              (torch.randn(SLOTS, HIDDEN, INTER) * 0.05).bfloat16())
             for _ in range(-(-CYCLED_BYTES // pool_bytes))]
    generator = torch.Generator().manual_seed(0)
    lines = [f"| MoE layer (64 slots of 3 MiB, {len(pools)} layers' pools) | base GB/s | new GB/s "
             "| new / base |", "|---|---|---|---|"]
    for tokens in MOE_TOKENS:
        calls = [routed_call(tokens, generator) for _ in range(24)]
        r = alternate(builds, partial(_moe_pass, calls, pools))
        lines.append(f"| {tokens} tokens | {r['base']:.1f} | {r['new']:.1f} | "
                     f"{r['new'] / r['base']:.2f}x |")
    return lines


def _attention_pass(args: tuple, lib: native.NativeKernels) -> int:
    q, keys, values, slots, starts, lengths = args
    lib.decode_attention(q, keys, values, slots, starts, lengths, HEAD_DIM ** -0.5, None)
    return 2 * slots.numel() * KV_HEADS * HEAD_DIM * keys.element_size()


def attention_rows(builds: dict[str, native.NativeKernels]) -> list[str]:
    generator = torch.Generator().manual_seed(1)
    lines = ["| decode attention (16 / 4 heads of 64) | base GB/s | new GB/s | new / base |",
             "|---|---|---|---|"]
    for tokens, length in ATTENTION_SHAPES:
        # the engine's blocks of 16 slots, scattered over a store twice the size in use
        blocks = -(-tokens * length // KV_BLOCK)
        keys, values = (torch.randn(2 * blocks * KV_BLOCK, KV_HEADS, HEAD_DIM,
                                    generator=generator).bfloat16() for _ in range(2))
        chosen = torch.randperm(2 * blocks, generator=generator)[:blocks]
        slots = (chosen[:, None] * KV_BLOCK + torch.arange(KV_BLOCK)).flatten()
        slots = slots[:tokens * length]
        args = (torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).bfloat16(), keys,
                values, slots, torch.arange(tokens) * length, torch.full((tokens,), length))
        r = alternate(builds, partial(_attention_pass, args))
        lines.append(f"| {tokens} tokens x {length} keys | {r['base']:.1f} | {r['new']:.1f} | "
                     f"{r['new'] / r['base']:.2f}x |")
    return lines


PARTS = {"gemv": gemv_rows, "moe": moe_rows, "attention": attention_rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mox.bench.micro.native_ab",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the base sources")
    parser.add_argument("--name", help="also write bench/results/NAME.md")
    parser.add_argument("--base-flags", default=" ".join(native_build.TARGET_FLAGS),
                        help="the base build's target flags (default: the new build's, "
                             "%(default)s)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which kernels, of " + ", ".join(PARTS))
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        base = base_build(args.base, args.base_flags, folder)
        new = native_build.build(native.SOURCE_DIR)
        if base is None or new is None:
            raise SystemExit("the native kernels could not be built here")
        builds = {"base": native.NativeKernels(base), "new": native.NativeKernels(new)}
        lines = [line for part in parts for line in PARTS[part](builds) + [""]]
    head = ["# Native kernels: the working tree against " + args.base, "",
            f"- command: .venv/bin/python -m mox.bench.micro.native_ab --base {args.base}"
            + (f" --name {args.name}" if args.name else "")
            + (f" --parts {args.parts}" if args.parts != ",".join(PARTS) else "")
            + (f" --base-flags '{args.base_flags}'" if args.base_flags.split()
               != list(native_build.TARGET_FLAGS) else ""),
            f"- target flags: base {args.base_flags}, new {' '.join(native_build.TARGET_FLAGS)}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- machine: {describe()}", f"- load average before: {load[0]:.2f}",
            f"- threads: {torch.get_num_threads()}", "",
            "GB/s of weights (keys and values) read, median of alternated passes: base -> new "
            "(new / base).", ""]
    text = "\n".join(head + lines)
    print(text)
    if args.name:
        (RESULTS_DIR / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
