"""Rounds of concurrent streams against `mox serve` under a tight budget: the round-time
distribution (a stall shows as a round far above the median), with the server's step log and
watchdog warnings to explain the slowest round.

Per round, `--streams` streaming completions (`--max-tokens` each, ignore_eos, random
token-id prompts of 4-40 tokens) go to models drawn uniformly from four demo models; a
`--leave` share of the clients disconnects after their second chunk. The server is
`mox serve --device-memory BUDGET --policy POLICY --step-log FILE`, started once for all
rounds. The report lists min / p50 / p90 / max round seconds, rounds over 10x the median,
the watchdog's warnings, and the slowest round's slowest steps.

    .venv/bin/python -m mox.bench.micro.stream_rounds [--rounds 30] [--streams 150]
        [--leave 0.5] [--budget 64MiB] [--policy rate] [--serve-arg=--compute-threads=1]
        [--out bench/results/stream_rounds.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from mox.demo import default_home, ensure_demo_models
from mox.engine.threads import cpu_times
from mox.registry import Registry
from mox.router.timeline import StepRecord, read_log

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
STALL_FACTOR = 10.0          # a round this many times the median is a stall
START_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 600.0


def registry_home(models_home: str) -> tuple[str, list[str]]:
    """A registry of its own holding just the four demo models (built if missing)."""
    paths = ensure_demo_models(models_home, architectures=ARCHITECTURES)
    home = tempfile.mkdtemp(prefix="mox-rounds-")
    registry = Registry(home)
    for name, path in paths.items():
        registry.add(name, path)
    return home, list(paths)


def start_server(home: str, budget: str, policy: str, step_log: str,
                 extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "mox.cli", "serve", "--home", home, "--port", "0",
               "--device-memory", budget, "--policy", policy, "--step-log", step_log, *extra]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        if match := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return server, match.group(1)
        if not line and server.poll() is not None:
            break
    server.kill()
    raise RuntimeError("mox serve did not start")


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, leave: bool) -> bool:
    """True if the stream ended with [DONE] (or the client left as planned)."""
    chunks = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            return False
        async for line in response.content:
            if line.strip() == b"data: [DONE]":
                return True
            chunks += line.startswith(b"data: ")
            if leave and chunks >= 2:
                return True
    return False


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far: the machine's busy (steal included) and stolen time, the server's."""
    times = cpu_times(pid)
    return {"busy": times.busy - times.steal, "steal": times.steal, "server": times.process}


async def run_rounds(base: str, models: list[str], args: argparse.Namespace,
                     server_pid: int) -> list[dict]:
    rng, rounds = random.Random(0), []
    url = base + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=ROUND_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for index in range(args.rounds):
            bodies = [{"model": rng.choice(models), "max_tokens": args.max_tokens,
                       "prompt": [rng.randrange(3, 90) for _ in range(rng.randrange(4, 40))],
                       "stream": True, "ignore_eos": True} for _ in range(args.streams)]
            start, wall, cpu = time.monotonic(), time.perf_counter(), cpu_seconds(server_pid)
            done = await asyncio.gather(*[one_stream(session, url, b, rng.random() < args.leave)
                                          for b in bodies], return_exceptions=True)
            used = {k: v - cpu[k] for k, v in cpu_seconds(server_pid).items()}
            rounds.append({"round": index, "start": start,
                           "seconds": time.perf_counter() - wall,
                           "failed": sum(d is not True for d in done),
                           "server_cpu_s": used["server"], "steal_s": used["steal"],
                           "others_cpu_s": used["busy"] - used["server"]})
            print(f"round {index}: {rounds[-1]['seconds']:.1f} s, "
                  f"{rounds[-1]['failed']} failed", flush=True)
    return rounds


def report(args: argparse.Namespace, rounds: list[dict], steps: list[StepRecord],
           warnings: list[str]) -> str:
    seconds = np.array([r["seconds"] for r in rounds])
    p50 = float(np.median(seconds))
    stalls = [r for r in rounds if r["seconds"] > STALL_FACTOR * p50]
    slowest = max(rounds, key=lambda r: r["seconds"])
    in_slowest = [s for s in steps
                  if slowest["start"] <= s.start < slowest["start"] + slowest["seconds"]]
    lines = [
        f"# Stream rounds ({args.policy}, {args.budget})", "",
        f"`{' '.join(['python -m mox.bench.micro.stream_rounds', *sys.argv[1:]])}`; "
        f"{args.rounds} rounds of {args.streams} streams ({args.max_tokens} tokens, "
        f"{args.leave:.0%} leaving early) over {', '.join(ARCHITECTURES)} demo models; "
        f"`uptime`: {os.getloadavg()[0]:.2f} (1 min load) at the end.", "",
        "| rounds | min s | p50 s | p90 s | max s | over 10x p50 | failed streams | "
        "watchdog warnings |", "|---|---|---|---|---|---|---|---|",
        f"| {len(rounds)} | {seconds.min():.1f} | {p50:.1f} | "
        f"{np.percentile(seconds, 90):.1f} | {seconds.max():.1f} | {len(stalls)} | "
        f"{sum(r['failed'] for r in rounds)} | {len(warnings)} |", "",
        "Round seconds: " + ", ".join(f"{s:.1f}" for s in seconds), "",
        f"Slowest round ({slowest['round']}, {slowest['seconds']:.1f} s): {len(in_slowest)} "
        f"steps, {sum(s.seconds for s in in_slowest):.1f} s stepping "
        f"({sum(s.cpu_seconds for s in in_slowest):.1f} s of the engine thread's CPU), "
        f"{sum(s.stall_seconds for s in in_slowest):.1f} s of it waiting on expert reads; "
        f"the server used {slowest['server_cpu_s']:.1f} CPU-s, other processes "
        f"{slowest['others_cpu_s']:.1f}, the host stole {slowest['steal_s']:.1f}. Median "
        f"round: server {np.median([r['server_cpu_s'] for r in rounds]):.1f} CPU-s, others "
        f"{np.median([r['others_cpu_s'] for r in rounds]):.1f}, stolen "
        f"{np.median([r['steal_s'] for r in rounds]):.1f}. Its slowest steps:", "",
        "| model | seqs | tokens (prefill) | s | thread CPU s | stalled s | misses | waves |",
        "|---|---|---|---|---|---|---|---|"]
    for s in sorted(in_slowest, key=lambda s: -s.seconds)[:5]:
        lines.append(f"| {s.model} | {s.num_seqs} | {s.num_tokens} ({s.num_prefill_tokens}) | "
                     f"{s.seconds:.2f} | {s.cpu_seconds:.2f} | {s.stall_seconds:.2f} | "
                     f"{s.misses} | {s.waves} |")
    lines += ["", *[f"- watchdog: {w}" for w in warnings[:10]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mox.bench.micro.stream_rounds",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=default_home(), help="where the demo models live")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--streams", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--leave", type=float, default=0.5)
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--policy", default="rate")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more argument for mox serve (repeatable), e.g. "
                        "--serve-arg=--compute-threads=1")
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "results"
                                             / "stream_rounds.md"))
    args = parser.parse_args(argv)
    home, models = registry_home(args.home)
    step_log = os.path.join(home, "steps.jsonl")
    server, base = start_server(home, args.budget, args.policy, step_log, args.serve_arg)
    try:
        rounds = asyncio.run(run_rounds(base, models, args, server.pid))
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=60)
    warnings = [line.split("mox: ", 1)[-1] for line in stderr.splitlines()
                if "step running for" in line]
    steps, _ = read_log(step_log)
    text = report(args, rounds, steps, warnings)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rounds, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
