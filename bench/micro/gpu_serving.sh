#!/usr/bin/env bash
# GPU check of serving through the pager (bench/micro/gpu_serving.py), preceded by the kernel tests
# on CUDA (tests/kernels: the Triton cases run on the GPU); `--phase big` instead builds and
# serves a Qwen3-30B-A3B-shaped model (minutes). Carry .whl (msgspec for the
# machine's python3.12) along. Results land in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
source bench/micro/gpu_setup.sh
if [[ " $* " != *" big "* ]]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -15 \
      | tee "$OUT/kernel_tests.log"
fi
python3 -m mox.bench.micro.gpu_serving --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_serving.log"
