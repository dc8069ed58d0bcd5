#!/usr/bin/env bash
# The GPU check of the Triton fused-MoE kernels, one prepared script (under 10 minutes on an
# H200): install mox into the machine's python (no network: no deps, no build isolation),
# check and time the kernels with the default block sizes, tune block sizes for the two
# realistic shapes, and time again with the tuned configs. Results land in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/configs"
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
source bench/micro/gpu_setup.sh
python3 -m mox.bench.micro.gpu_kernels --out "$OUT" --phase default 2>&1 | tee "$OUT/default.log"
TUNE_BUDGET=${TUNE_BUDGET:-90}
python3 -m mox.bench.micro.tune_moe --experts 8 --hidden 4096 --inter 14336 --top-k 2 \
    --budget-s "$TUNE_BUDGET" --out "$OUT/configs" 2>&1 | tee "$OUT/tune.log"
python3 -m mox.bench.micro.tune_moe --experts 128 --hidden 2048 --inter 768 --top-k 8 \
    --budget-s "$TUNE_BUDGET" --out "$OUT/configs" 2>&1 | tee -a "$OUT/tune.log"
cp "$OUT"/configs/*.json kernels/configs/ 2>/dev/null
# config names hold "=" and ",", which $OUT cannot return: pack them
tar -cf "$OUT/configs.tar" -C "$OUT/configs" . && rm -r "$OUT/configs"
python3 -m mox.bench.micro.gpu_kernels --out "$OUT" --phase tuned 2>&1 | tee "$OUT/tuned.log"
# issue 19: the int8 / int4 / FP8 / MXFP4 pools against bf16 at Qwen3-30B-A3B and DeepSeek-V3
# expert shapes (~1-2 minutes)
python3 -m mox.bench.micro.gpu_kernels --out "$OUT" --phase quantized 2>&1 | tee "$OUT/quantized.log"
