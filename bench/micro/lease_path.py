"""The pager's per-layer work for a decode step when every expert is resident: one
`ModelPool.waves(layer, experts)` call (usage, the miss-ratio curve, classify, lease map,
release) with top_k random experts, on the bench olmoe's pool (8 MoE layers x 64 experts).

    python -m mox.bench.micro.lease_path [--home DIR] [--calls N]

prints microseconds per call (best of three passes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mox.demo import default_home, ensure_demo_models
from mox.loaders import Checkpoint
from mox.pager import make_pager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=None, help="MOX_HOME (default $MOX_HOME or ~/.cache/mox)")
    ap.add_argument("--calls", type=int, default=4000)
    args = ap.parse_args()
    path = next(iter(ensure_demo_models(args.home or default_home(), "bench", 0.0,
                                        ("olmoe",)).values()))
    ckpt = Checkpoint(path)
    spec = ckpt.spec
    cpu = torch.device("cpu")
    pool = make_pager(cpu, None).add_model("m", ckpt, torch.bfloat16, cpu, None, "rate")
    layers = spec.num_moe_layers
    pool.preload({layer: list(range(spec.num_experts)) for layer in range(layers)})
    rng = np.random.default_rng(0)
    calls = [sorted(rng.choice(spec.num_experts, spec.top_k, replace=False).tolist())
             for _ in range(args.calls)]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i, experts in enumerate(calls):
            for _lease in pool.waves(i % layers, experts):
                pass
        best = min(best, (time.perf_counter() - start) / len(calls))
    print(f"{best * 1e6:.1f} us per MoE layer call ({len(calls)} calls, best of 3)")


if __name__ == "__main__":
    main()
