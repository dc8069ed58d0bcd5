"""Compile the GPU decode step's Triton kernels for an NVIDIA target without a GPU (Triton's
own compiler and ptxas), at the shapes serving uses: a kernel that does not compile, or that
lost its vector loads, shows here before a GPU session is spent on it.

    .venv/bin/python -m mox.bench.micro.triton_compile [--arch 90]

Run without TRITON_INTERPRET. Pointer and stride arguments are declared 16-divisible, as
Triton's launcher specializes them at run time. Prints each kernel variant's cubin size, and
decode attention's vector (`ld.global.v4`) and scalar 16-bit global loads, anchored or not.
"""

from __future__ import annotations

import argparse
import inspect
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_kernel(fn, types: dict[str, str], constexprs: dict, target: GPUTarget):
    """`fn` compiled with these argument types (default i32) and constexpr values."""
    params = list(inspect.signature(fn.fn).parameters)
    signature, values, attrs = {}, {}, {}
    for i, name in enumerate(params):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
            continue
        signature[name] = types.get(name, "i32")
        if signature[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    return triton.compile(source, target=target, options={"num_warps": 4})


def variants():
    """(label, kernel, argument types, constexprs) at serving shapes."""
    from mox.kernels import attention_triton, moe_align, triton_ops
    pow2 = triton.next_power_of_2
    for anchored in (False, True):
        offsets = "*i64" if anchored else "*bf16"
        types = {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "keys_ptr",
                                      "values_ptr")}
        types.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64",
                     kv_offsets_ptr=offsets)
        for interleaved, dim, rotary in ((False, 128, 128), (True, 64, 64), (False, 80, 32)):
            yield (f"rope_kv anchored={anchored} interleaved={interleaved} d={dim} r={rotary}",
                   triton_ops._rope_kv_kernel, types,
                   dict(HEADS=16, KV_HEADS=4, HEAD_DIM=dim, VALUE_DIM=dim, HALF=rotary // 2,
                        INTERLEAVED=interleaved, BLOCK_REST=pow2(max(dim - rotary, 1)),
                        BLOCK_V=pow2(dim), ANCHORED=anchored))
        types = {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        types.update(slots_ptr="*i64", starts_ptr="*i64", lengths_ptr="*i64",
                     kv_offsets_ptr=offsets, scale="fp32")
        yield (f"decode_attention anchored={anchored}", attention_triton._decode_attention_kernel,
               types, dict(GROUP=4, HEAD_DIM=128, VALUE_DIM=128, BLOCK_G=4, BLOCK_D=128,
                           BLOCK_DV=128, BLOCK_N=16, ANCHORED=anchored))
    for residual in (False, True):
        yield (f"rms_norm residual={residual}", triton_ops._rms_norm_kernel,
               {p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr", "sum_ptr", "out_ptr")}
               | {"eps": "fp32"}, dict(RESIDUAL=residual, BLOCK=2048))
    for block_m in (16, 64):
        pairs, experts = 512, 128
        blocks = moe_align.max_padded(pairs, experts, block_m) // block_m
        yield (f"align block_m={block_m}", moe_align._align_kernel,
               {p: "*i32" for p in ("ids_ptr", "slot_of_ptr", "count_ptr", "rank_ptr",
                                    "sorted_ptr", "block_slot_ptr", "num_padded_ptr")},
               dict(BLOCK_M=block_m, CHUNK=64, RUN_BLOCKS=pow2(triton.cdiv(pairs, block_m)),
                    BLOCKS=pow2(blocks), TAIL=1024))
    routing = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
               "ids_ptr": "*i32", "mark_ptr": "*i32", "scaling": "fp32"}
    for experts, k in ((64, 8), (60, 4), (128, 8)):
        yield (f"softmax_topk E={experts} k={k}", triton_ops._softmax_topk_kernel, routing,
               dict(K=k, BLOCK_K=pow2(k), BLOCK_E=pow2(experts), RENORM=True, MARK=True))
    for groups, size, kept, k in ((8, 32, 4, 8), (1, 128, 1, 8)):
        yield (f"sigmoid_grouped G={groups} size={size}", triton_ops._sigmoid_grouped_kernel,
               routing, dict(GROUPS=groups, GROUP_SIZE=size, KEEP_GROUPS=kept, K=k,
                             BLOCK_K=pow2(k), HAS_BIAS=True, RENORM=True, MARK=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability")
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") != "1", "compiles for a GPU: unset TRITON_INTERPRET"
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for label, fn, types, constexprs in variants():
        try:
            kernel = compile_kernel(fn, types, constexprs, target)
        except Exception as exc:                 # report every variant, then fail
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:500]}")
            continue
        line = f"ok   {label}: cubin {len(kernel.asm['cubin'])} B"
        if label.startswith("decode_attention"):
            ptx = kernel.asm["ptx"]
            line += (f", {ptx.count('ld.global.v4')} vector and "
                     f"{ptx.count('ld.global.b16')} 16-bit global loads")
        print(line)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
