"""GPU check of serving through the pager: the models' MoE blocks on the Triton kernels with
experts paged into CUDA slot pools (pinned staging, side-stream copies, host tier).

    python -m mox.bench.gpu_serving --out DIR

1. Each demo architecture, fp32: greedy tokens on CUDA with a tiny expert budget (waves,
   evictions) and a host cache equal those on CUDA with every expert resident, and those on
   CPU (torch path): the kernels, the pager and the copies agree end to end.
2. The bench-size olmoe (bf16, 1.6 GB of experts): decode tokens/s and prefill time on CUDA
   with all experts resident against a quarter of them (paged from the host cache / disk).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mox import LLM
from mox.demo import DEMO_ARCHITECTURES, demo_name, ensure_demo_models

PROMPT = "The expert pager streams experts into slots"


def greedy(llm: LLM, max_tokens: int = 16) -> list[int]:
    return llm.generate(PROMPT, max_tokens=max_tokens, temperature=0.0,
                        ignore_eos=True)[0].token_ids


def parity(home: str) -> list[dict]:
    rows = []
    for arch in DEMO_ARCHITECTURES:
        path = os.path.join(home, "models", demo_name(arch))
        reference = greedy(LLM(path, device="cpu", dtype="float32"))
        resident = greedy(LLM(path, device="cuda", dtype="float32"))
        paged_llm = LLM(path, device="cuda", dtype="float32", expert_memory="6MiB",
                        host_memory="64MiB")
        paged = greedy(paged_llm)
        stats = paged_llm.pager_stats()
        row = {"arch": arch, "cuda_resident_equals_cpu": resident == reference,
               "cuda_paged_equals_cpu": paged == reference, "misses": stats["misses"],
               "waves": stats["waves"], "evictions": stats["evictions"],
               "bytes_read_host": stats["bytes_read_host"]}
        print(row, flush=True)
        rows.append(row)
    return rows


def timed_generate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt_ids], max_tokens=max_tokens, temperature=0.0,
                 ignore_eos=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def speed(home: str) -> list[dict]:
    path = ensure_demo_models(home, "bench", 1.0, ("olmoe",))[demo_name("olmoe", "bench", 1.0)]
    rows = []
    for label, kwargs in [("all resident", {}),
                          ("25% of experts, host cache", {"expert_memory": "400MiB",
                                                          "host_memory": "2GiB"})]:
        llm = LLM(path, device="cuda", dtype="bfloat16", **kwargs)
        prompt = list(range(100, 356))
        timed_generate(llm, prompt, 4)                                   # warm-up
        prefill = timed_generate(llm, prompt, 1)
        decode = timed_generate(llm, prompt[:8], 65) - timed_generate(llm, prompt[:8], 1)
        stats = llm.pager_stats()
        row = {"config": label, "prefill_256_s": prefill, "decode_tok_s": 64 / decode,
               "hits": stats["hits"], "misses": stats["misses"],
               "prefetch_hits": stats["prefetch_hits"],
               "bytes_read_host": stats["bytes_read_host"],
               "bytes_read_disk": stats["bytes_read_disk"]}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--home", default="/tmp/mox_home")
    args = parser.parse_args()
    ensure_demo_models(args.home)
    report = {"device": torch.cuda.get_device_name(), "parity": parity(args.home)}
    report["speed"] = speed(args.home)
    with open(os.path.join(args.out, "gpu_serving.json"), "w") as f:
        json.dump(report, f, indent=2)
    ok = all(r["cuda_resident_equals_cpu"] and r["cuda_paged_equals_cpu"]
             for r in report["parity"])
    print("parity ok" if ok else "PARITY FAILED")


if __name__ == "__main__":
    main()
