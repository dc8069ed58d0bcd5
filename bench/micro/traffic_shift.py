"""One shift of traffic through the router, in real time: Poisson arrivals go to model A for
the first phase and to model B for the second; every planning period prints each model's
request rate, planned expert slots and the device memory in use.

    .venv/bin/python -m mox.bench.micro.traffic_shift [--home DIR] [--phase-s 15] [--rate 4]

Writes bench/results/traffic_shift.md (the table) unless --no-save.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from mox.demo import ensure_demo_models
from mox.messages import Request
from mox.router import Router, RouterConfig
from mox.sampling import SamplingParams

RESULTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "results", "traffic_shift.md")
MODELS = ("olmoe", "qwen3_moe", "mixtral")          # A, B, and an idle third


def _router(home: str, expert_share: float) -> Router:
    paths = ensure_demo_models(home, architectures=MODELS)
    probe = Router(paths, RouterConfig())
    dense = sum(m.dense_nbytes for m in probe.models.values())
    experts = sum(m.pool.max_slots * m.pool.expert_nbytes for m in probe.models.values())
    budget = dense + int(expert_share * experts)
    return Router(paths, RouterConfig(device_memory=budget, plan_period_s=1.0))


def run(home: str, phase_s: float, rate: float, seed: int = 0) -> list[str]:
    router = _router(home, expert_share=0.3)
    names = list(router.models)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    next_arrival, next_report, count = start, start + 1.0, 0
    rows = [f"device budget {router.config.device_memory / 2**20:.1f} MiB (dense of all + 30% "
            "of experts); Poisson arrivals at "
            f"{rate}/s to {names[0]}, then to {names[1]}; {names[2]} idle", "",
            "| t (s) | " + " | ".join(f"{n} rate/s, slots" for n in names)
            + " | used MiB |", "|---|" + "---|" * (len(names) + 1)]
    while (now := time.monotonic()) < start + 2 * phase_s:
        while next_arrival <= now:
            target = names[0] if next_arrival < start + phase_s else names[1]
            prompt = rng.integers(3, 200, size=8).tolist()
            router.add_request(Request(f"r{count}", target, prompt, params))
            count += 1
            next_arrival += rng.exponential(1 / rate)
        router.step()
        if now >= next_report:
            snap = router.snapshot()
            cells = [f"{snap['models'][n]['request_rate']:.2f}, "
                     f"{snap['models'][n].get('planned_slots', 0)}" for n in names]
            rows.append(f"| {now - start:.0f} | " + " | ".join(cells)
                        + f" | {snap['device_used_bytes'] / 2**20:.1f} |")
            print(rows[-1], flush=True)
            next_report += 1.0
    router.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--home", default="/tmp/mox-shift-home")
    parser.add_argument("--phase-s", type=float, default=15.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = run(args.home, args.phase_s, args.rate)
    if not args.no_save:
        with open(RESULTS, "w", encoding="utf-8") as f:
            f.write("# Traffic shift through the router\n\n`.venv/bin/python -m "
                    "mox.bench.micro.traffic_shift` (demo models, bf16, CPU)\n\n"
                    + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
