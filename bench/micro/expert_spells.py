"""A/B of the MoE experts kernel (kernels/csrc/moe_experts.c) split by the VM's memory spells,
with an A/A control: the working tree's build against a git revision's (`--base`), and a copy
of the base build against the base, in ABBA pairs over eight layers' slot pools (1.5 GiB, so
every call reads from memory), for `--seconds`.

This VM's memory streams at ~40-50 GB/s for minutes, then at ~70-75 for a while. Before each
round the native GEMV's 1 GiB read rate is probed (as mox.bench.micro.throughput's bound takes
it) and the round counts as fast when it reads at least `--fast-gbps`. Per spell and token
count: how many rounds, the median of new / base over the rounds' pairs, the same for the
control (identical code: the harness's own bias), and base's rate over the probe's.

    .venv/bin/python -m mox.bench.micro.expert_spells [--base REV] [--seconds 600]
        [--tokens 1,32] [--fast-gbps 62] [--name NAME]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from mox.bench.machine import describe
from mox.bench.micro.native_ab import HIDDEN, INTER, SLOTS, base_build, routed_call
from mox.bench.micro.throughput import ReadRates
from mox.kernels import native, native_build

RESULTS_DIR = Path(__file__).parent.parent / "results"
LAYERS = 8                # the bench olmoe's MoE layers: 1.5 GiB of experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--fast-gbps", type=float, default=62.0)
    ap.add_argument("--name", default="expert_spells")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:      # the loaded builds outlive their files
        lines = _measure(args, folder)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _measure(args: argparse.Namespace, folder: str) -> list[str]:
    """The rounds, until `args.seconds` have passed: the report's lines."""
    base_path = base_build(args.base, " ".join(native_build.TARGET_FLAGS), folder)
    if base_path is None or native.kernels() is None:
        raise SystemExit("the native kernels could not be built here")
    control = Path(folder, "control.so")           # the base's bytes at another path: a
    shutil.copy(base_path, control)                # second handle, not the same library
    builds = {"base": native.NativeKernels(base_path), "new": native.kernels(),
              "control": native.NativeKernels(str(control))}
    generator = torch.Generator().manual_seed(0)
    pools = [((torch.randn(SLOTS, 2 * INTER, HIDDEN, generator=generator) * 0.05).bfloat16(),
              (torch.randn(SLOTS, HIDDEN, INTER, generator=generator) * 0.05).bfloat16())
             for _ in range(LAYERS)]
    tokens = [int(t) for t in args.tokens.split(",")]
    calls = {t: routed_call(t, generator) for t in tokens}

    expert_bytes = (pools[0][0][0].numel() + pools[0][1][0].numel()) * 2

    def rate(lib: native.NativeKernels, t: int) -> float:
        runs, rows, weights, scratch = calls[t]
        start = time.perf_counter()
        for w13, w2 in pools:
            lib.moe_experts(rows, w13, w2, runs, weights, scratch)
        return len(runs) * LAYERS * expert_bytes / (time.perf_counter() - start) / 1e9

    probe, ratios = ReadRates(), defaultdict(list)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    deadline = time.time() + args.seconds
    while time.time() < deadline:
        stream = probe(3)["native_gbps"]
        spell = "fast" if stream >= args.fast_gbps else "slow"
        for t in tokens:
            for other in ("new", "control"):
                pair = [("base", builds["base"]), (other, builds[other])]
                got = defaultdict(list)
                for tag, lib in pair + pair[::-1]:
                    got[tag].append(rate(lib, t))
                ratios[spell, t, other].append(statistics.mean(got[other])
                                               / statistics.mean(got["base"]))
            ratios[spell, t, "stream"].append(statistics.mean(got["base"]) / stream)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# MoE experts A/B by memory spell: the working tree against {args.base}", "",
             f"- command: python -m mox.bench.micro.expert_spells --base {args.base} --seconds "
             f"{args.seconds:g} --tokens {args.tokens} --fast-gbps {args.fast_gbps:g} "
             f"--name {args.name}",
             f"- date: {now.isoformat(timespec='seconds')}",
             f"- uptime before: {uptime}", f"- machine: {describe()}", "",
             "Medians over the rounds of each spell: new / base and control / base (ABBA pairs, "
             "the same routing), base's GB/s over the probe's.", "",
             "| spell | tokens | rounds | new / base | control / base | base / probe |",
             "|---|---|---|---|---|---|"]
    for spell in ("slow", "fast"):
        for t in tokens:
            new = ratios[spell, t, "new"]
            if new:
                lines.append(f"| {spell} | {t} | {len(new)} | {statistics.median(new):.3f} | "
                             f"{statistics.median(ratios[spell, t, 'control']):.3f} | "
                             f"{statistics.median(ratios[spell, t, 'stream']):.3f} |")
    return lines


if __name__ == "__main__":
    main()
