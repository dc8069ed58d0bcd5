"""GPU check of serving through the pager: the models' MoE blocks on the Triton kernels with
experts paged into CUDA slot pools (pinned staging, side-stream copies, host tier).

    python -m mox.bench.micro.gpu_serving --out DIR

1. Each demo architecture, fp32: greedy tokens on CUDA with a pool of top_k + 1 slots
   (waves, evictions) and a host cache, cold and then warm, equal those on CUDA with every
   expert resident, and those on CPU (torch path): the kernels, the pager and the copies agree
   end to end. Decode steps replay CUDA graphs (mox.models.decode_graphs) where the model
   takes them; the resident run is repeated eagerly (`use_graphs(None)`) and must agree too.
2. The bench-size olmoe (bf16, 1.6 GB of experts): prefill time and decode tokens/s at 1, 8
   and 32 sequences on CUDA, all experts resident (with graphs, and eagerly) and a quarter of
   them (paged from the host cache / disk), against transformers' `generate` on the same
   checkpoint and GPU; the GPU's busy share of a 32-sequence decode (kernel time / wall time).
3. Where a batch-1 decode step's time goes on CUDA (torch.profiler, top ops).
4. `--phase big` (alone: building the checkpoint takes minutes): a Qwen3-30B-A3B-shaped model
   with half its layers (random weights, E=128, k=8, H=2048, I=768, 24 layers; ~30 GB bf16,
   built on the machine's disk) under a 10 GiB expert budget: cold TTFT (page cache emptied)
   and decode tok/s, against the HBM bound (a token's active bytes / copy bandwidth) and the
   link bound (the bytes it paged in / pinned host-to-device bandwidth), both measured in
   the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mox import LLM
from mox.demo import DEMO_ARCHITECTURES, Size, build_checkpoint, demo_name, ensure_demo_models
from mox.loaders.page_cache import evict

PROMPT = "The expert pager streams experts into slots"
DECODE_TOKENS = 64


def greedy(llm: LLM, max_tokens: int = 16) -> list[int]:
    return llm.generate(PROMPT, max_tokens=max_tokens, temperature=0.0,
                        ignore_eos=True)[0].token_ids


def parity(home: str) -> list[dict]:
    rows = []
    for arch in DEMO_ARCHITECTURES:
        path = os.path.join(home, "models", demo_name(arch))
        row: dict = {"arch": arch}
        try:
            reference = greedy(LLM(path, device="cpu", dtype="float32"))
            resident_llm = LLM(path, device="cuda", dtype="float32")
            resident = greedy(resident_llm)
            graphs = resident_llm.model.graphs
            row["graph_sizes"] = [] if graphs is None else graphs.sizes
            resident_llm.model.use_graphs(None)
            row["cuda_eager_equals_graphs"] = greedy(resident_llm) == resident
            top_k = resident_llm.model.spec.top_k
            expert_bytes = resident_llm.pager_stats()["expert_bytes"]
            paged_llm = LLM(path, device="cuda", dtype="float32",
                            expert_memory=(top_k + 1) * expert_bytes, host_memory="64MiB")
            paged = greedy(paged_llm)
            paged_warm = greedy(paged_llm)
            stats = paged_llm.pager_stats()
            row.update({"cuda_resident_equals_cpu": resident == reference,
                        "cuda_paged_equals_cpu": paged == reference,
                        "cuda_paged_warm_equals_cpu": paged_warm == reference,
                        "graph_captures": stats["graph_captures"],
                        "mapped_reads": stats["mapped_reads"],
                        "misses": stats["misses"], "waves": stats["waves"],
                        "evictions": stats["evictions"],
                        "bytes_read_host": stats["bytes_read_host"]})
        except Exception as exc:                  # report every architecture, then fail
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(row, flush=True)
        rows.append(row)
    return rows


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def prompts(num_seqs: int, length: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 5000 for j in range(length)] for i in range(num_seqs)]


def mox_decode_tok_s(llm: LLM, num_seqs: int) -> float:
    batch = prompts(num_seqs, 8)

    def run(max_tokens: int):
        return lambda: llm.generate(prompt_token_ids=batch, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True)
    run(3)()                # Triton compiles per batch-size bucket: keep that out of the timing
    decode = timed(run(DECODE_TOKENS + 1)) - timed(run(1))
    return num_seqs * DECODE_TOKENS / decode


def hf_decode_tok_s(path: str) -> dict:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    out = {}
    for num_seqs in (1, 8, 32):
        ids = torch.tensor(prompts(num_seqs, 8), device="cuda")

        def run(new: int, ids: torch.Tensor = ids):
            return lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, attention_mask=torch.ones_like(ids))
        with torch.inference_mode():
            run(2)()
            decode = timed(run(DECODE_TOKENS + 1)) - timed(run(1))
        out[num_seqs] = num_seqs * DECODE_TOKENS / decode
    model.to("cpu")
    torch.cuda.empty_cache()
    return out


def prefill_seconds(llm: LLM) -> float:
    prompt = list(range(100, 356))
    timed(lambda: llm.generate(prompt_token_ids=[prompt], max_tokens=4))         # warm-up
    return timed(lambda: llm.generate(prompt_token_ids=[prompt], max_tokens=1))


def profile_step(llm: LLM) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    batch = prompts(1, 8)
    llm.generate(prompt_token_ids=batch, max_tokens=4, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=batch, max_tokens=9, temperature=0.0, ignore_eos=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    cuda_table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12)
    return table.splitlines() + cuda_table.splitlines()


def busy_share(llm: LLM, num_seqs: int) -> float:
    """GPU kernel time over wall time of a decode of `num_seqs` sequences (the profiler)."""
    from torch.profiler import ProfilerActivity, profile
    batch = prompts(num_seqs, 8)
    llm.generate(prompt_token_ids=batch, max_tokens=4, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(lambda: llm.generate(prompt_token_ids=batch, max_tokens=DECODE_TOKENS,
                                          temperature=0.0, ignore_eos=True))
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernel_us / 1e6 / wall


def speed(home: str) -> dict:
    path = ensure_demo_models(home, "bench", 1.0, ("olmoe",))[demo_name("olmoe", "bench", 1.0)]
    rows = []
    profile_lines: list[str] = []
    for label, kwargs, graphs in [
            ("all resident, graphs", {}, True), ("all resident, eager", {}, False),
            ("25% of experts, host cache, graphs", {"expert_memory": "400MiB",
                                                    "host_memory": "2GiB"}, True)]:
        llm = LLM(path, device="cuda", dtype="bfloat16", **kwargs)
        if not graphs:
            llm.model.use_graphs(None)
        row = {"config": label, "prefill_256_s": prefill_seconds(llm)}
        for num_seqs in (1, 8, 32):
            row[f"decode_tok_s_{num_seqs}"] = mox_decode_tok_s(llm, num_seqs)
        row["gpu_busy_share_32"] = busy_share(llm, 32)
        stats = llm.pager_stats()
        row.update({key: stats[key] for key in ("hits", "misses", "prefetch_hits",
                                                "mapped_reads", "bytes_read_host",
                                                "bytes_read_disk", "graph_captures",
                                                "graph_capture_seconds")})
        print(row, flush=True)
        rows.append(row)
        if not profile_lines:
            profile_lines = profile_step(llm)
        llm.router.shutdown()
        torch.cuda.empty_cache()
    hf = hf_decode_tok_s(path)
    print({"transformers_decode_tok_s": hf}, flush=True)
    return {"rows": rows, "transformers_decode_tok_s": hf, "profile_batch1": profile_lines}


# Qwen3-30B-A3B's shapes, half its 48 layers: ~29 GB of experts in bf16
QWEN3_30B_HALF = Size(2048, 24, 32, 4, 128, experts=128, top_k=8, moe_intermediate=768,
                      vocab=32000)


def copy_gb_s(pinned: bool) -> float:
    """HBM bytes moved a second by a device-to-device copy (each byte read and written:
    pinned=False), or the pinned host-to-device rate, GB/s."""
    size = 1 << 30
    src = (torch.empty(size, dtype=torch.uint8, pin_memory=True) if pinned
           else torch.empty(size, dtype=torch.uint8, device="cuda"))
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    moved = size if pinned else 2 * size
    return moved / 1e9 / min(timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))


def big(home: str) -> dict:
    path = os.path.join(home, "models", "qwen3-30b-a3b-half")
    started = time.perf_counter()
    if not os.path.exists(os.path.join(path, "config.json")):
        build_checkpoint(path, "qwen3_moe", QWEN3_30B_HALF, max_shard_bytes=4 << 30)
    report: dict = {"build_s": time.perf_counter() - started,
                    "hbm_gb_s": copy_gb_s(pinned=False), "h2d_gb_s": copy_gb_s(pinned=True)}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            evict(os.path.join(path, name))
    started = time.perf_counter()
    llm = LLM(path, device="cuda", dtype="bfloat16", expert_memory="10GiB",
              host_memory="48GiB")
    report["open_s"] = time.perf_counter() - started
    report["cold_ttft_8_s"] = timed(lambda: llm.generate(prompt_token_ids=prompts(1, 8),
                                                         max_tokens=1))
    report["ttft_32_s"] = timed(lambda: llm.generate(prompt_token_ids=prompts(1, 32),
                                                     max_tokens=1))
    spec, stats = llm.model.spec, llm.pager_stats()
    dense = llm.model.lm_head.numel() * llm.model.lm_head.element_size()   # (embed: a row)
    for layer in llm.model.layers:
        dense += sum(t.numel() * t.element_size() for t in (layer.attention.qkv,
                                                             layer.attention.o))
    token_bytes = dense + spec.num_layers * spec.top_k * stats["expert_bytes"]
    report["hbm_bound_tok_s_1"] = report["hbm_gb_s"] * 1e9 / token_bytes
    for num_seqs in (1, 8):
        before = llm.pager_stats()
        report[f"decode_tok_s_{num_seqs}"] = mox_decode_tok_s(llm, num_seqs)
        after = llm.pager_stats()
        paged = sum(after[k] - before[k] for k in ("bytes_read_host", "bytes_read_disk"))
        report[f"paged_gb_{num_seqs}"] = paged / 1e9
    report["graph_captures"] = llm.pager_stats()["graph_captures"]
    print(report, flush=True)
    llm.router.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--home", default="/tmp/mox_home")
    parser.add_argument("--phase", choices=("serving", "big"), default="serving")
    args = parser.parse_args()
    if args.phase == "big":
        with open(os.path.join(args.out, "gpu_serving_big.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "big": big(args.home)}, f,
                      indent=2)
        return
    ensure_demo_models(args.home)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "parity": parity(args.home)}
    report["speed"] = speed(args.home)
    with open(os.path.join(args.out, "gpu_serving.json"), "w") as f:
        json.dump(report, f, indent=2)
    print("\n".join(report["speed"]["profile_batch1"]))
    ok = all(r.get("cuda_resident_equals_cpu") and r.get("cuda_paged_equals_cpu")
             and r.get("cuda_paged_warm_equals_cpu") and r.get("cuda_eager_equals_graphs")
             for r in report["parity"])
    print("parity ok" if ok else "PARITY FAILED")


if __name__ == "__main__":
    main()
