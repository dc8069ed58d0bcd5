"""A/B of the MoE kernel (kernels/csrc/moe_experts.c) as a share of the machine's streaming
rate: a git revision's sources (`--base`, default HEAD) against the working tree's, each built
into `moe_stream.c`'s harness, alternated one pass at a time for `--seconds`.

This VM's memory streams at ~31 GB/s for minutes, then at 45-56 for a while (another tenant's
load, presumably); a kernel's GB/s alone drifts with it, and native_ab's new / base compares
two builds only in whatever spell the run fell in. Here each pass times the decode GEMV over
256 MiB (the stream) right before the MoE calls, and the figures are each call's rate over
that stream's, split into the passes of slow spells and of fast ones (`--fast-gbps`).

    .venv/bin/python -m mox.bench.micro.moe_stream [--base REV] [--seconds 300]
        [--tokens 1,8,32] [--fast-gbps 40] [--name NAME]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from mox.bench.machine import describe
from mox.bench.micro.native_ab import base_sources

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE.parent / "results"
SOURCE_DIR = HERE.parent.parent / "kernels" / "csrc"


def build(source_dir: Path, target: Path) -> Path:
    sources = sorted(str(p) for p in source_dir.glob("*.c"))
    subprocess.run([os.environ.get("CC", "cc"), "-O3", "-ffp-contract=off", "-fopenmp",
                    f"-I{source_dir}", str(HERE / "moe_stream.c"), *sources, "-o", str(target),
                    "-lm"], check=True)
    return target


def one_pass(binary: Path, tokens: list[int]) -> dict[str, float]:
    """{"stream": GB/s, "8": GB/s, ...} of one pass."""
    out = subprocess.run([str(binary), "1", *map(str, tokens)], check=True,
                         capture_output=True, text=True).stdout.split()
    return {name: float(value) for name, value in zip(out[::2], out[1::2])}


def table(passes: dict[str, list[dict[str, float]]], tokens: list[int],
          fast_gbps: float) -> list[str]:
    lines = ["| spell | passes (base / new) | stream GB/s | "
             + " | ".join(f"{t} tokens: base, new (new / base)" for t in tokens) + " |",
             "|---|---|---|" + "---|" * len(tokens)]
    for spell, fast in (("slow", False), ("fast", True)):
        kept = {tag: [p for p in ps if (p["stream"] >= fast_gbps) == fast]
                for tag, ps in passes.items()}
        if not all(kept.values()):
            lines.append(f"| {spell} | {len(kept['base'])} / {len(kept['new'])} | | "
                         + " | " * (len(tokens) - 1) + " |")
            continue
        stream = statistics.median(p["stream"] for ps in kept.values() for p in ps)
        cells = []
        for t in tokens:
            share = {tag: statistics.median(p[str(t)] / p["stream"] for p in ps)
                     for tag, ps in kept.items()}
            cells.append(f"{share['base']:.2f}, {share['new']:.2f} "
                         f"({share['new'] / share['base']:.2f}x)")
        lines.append(f"| {spell} | {len(kept['base'])} / {len(kept['new'])} | {stream:.1f} | "
                     + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--fast-gbps", type=float, default=40.0)
    parser.add_argument("--name", default="moe_stream")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    load = os.getloadavg()[0]
    passes: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as folder:
        base_dir = Path(folder, "base")
        base_dir.mkdir()
        binaries = {"base": build(Path(base_sources(args.base, str(base_dir))),
                                  Path(folder, "moe_stream_base")),
                    "new": build(SOURCE_DIR, Path(folder, "moe_stream_new"))}
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            for tag, binary in binaries.items():
                passes[tag].append(one_pass(binary, tokens))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"# MoE kernel / stream, {args.base} against the working tree",
             "", f"- command: .venv/bin/python -m mox.bench.micro.moe_stream --base {args.base}"
             f" --seconds {args.seconds:g} --tokens {args.tokens} --fast-gbps {args.fast_gbps:g}"
             f" --name {args.name}",
             f"- date: {date}",
             f"- machine: {describe()}", f"- load average before: {load:.2f}",
             f"- threads: {os.environ.get('OMP_NUM_THREADS', os.cpu_count())}", "",
             "Per pass, each MoE call's GB/s of experts over the GB/s of the GEMV stream timed "
             f"just before; medians over the passes of slow spells (stream < {args.fast_gbps:g} "
             "GB/s) and of fast ones.", "", *table(passes, tokens, args.fast_gbps)]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
