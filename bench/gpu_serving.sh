#!/usr/bin/env bash
# GPU check of serving through the pager (bench/gpu_serving.py); carry .whl (msgspec for
# python3.12) along. Results land in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh
python3 -m mox.bench.gpu_serving --out "$OUT" 2>&1 | tee "$OUT/gpu_serving.log"
