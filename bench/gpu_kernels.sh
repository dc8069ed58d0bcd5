#!/usr/bin/env bash
# The GPU check of the Triton fused-MoE kernels, one prepared script (under 10 minutes on an
# H200): install mox into the machine's python (no network: no deps, no build isolation),
# check and time the kernels with the default block sizes, tune block sizes for the two
# realistic shapes, and time again with the tuned configs. Results land in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/configs"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3 \
    || ! python3 -c "import mox.kernels, mox.bench"; then
  # fallback without pip: map mox.kernels -> kernels/, mox.bench -> bench/ at start-up
  mkdir -p /tmp/mox_shim
  printf 'import sys\nsys.path.insert(0, "%s")\nimport mox\nmox.__path__.append("%s")\n' \
      "$PWD" "$PWD" > /tmp/mox_shim/sitecustomize.py
  export PYTHONPATH=/tmp/mox_shim
fi
python3 -c "import mox.kernels, triton, torch; print('mox ok; triton', triton.__version__, 'torch', torch.__version__)"
python3 -m mox.bench.gpu_kernels --out "$OUT" --phase default 2>&1 | tee "$OUT/default.log"
TUNE_BUDGET=${TUNE_BUDGET:-90}
python3 -m mox.bench.tune_moe --experts 8 --hidden 4096 --inter 14336 --top-k 2 \
    --budget-s "$TUNE_BUDGET" --out "$OUT/configs" 2>&1 | tee "$OUT/tune.log"
python3 -m mox.bench.tune_moe --experts 128 --hidden 2048 --inter 768 --top-k 8 \
    --budget-s "$TUNE_BUDGET" --out "$OUT/configs" 2>&1 | tee -a "$OUT/tune.log"
cp "$OUT"/configs/*.json kernels/configs/ 2>/dev/null
# config names hold "=" and ",", which $OUT cannot return: pack them
tar -cf "$OUT/configs.tar" -C "$OUT/configs" . && rm -r "$OUT/configs"
python3 -m mox.bench.gpu_kernels --out "$OUT" --phase tuned 2>&1 | tee "$OUT/tuned.log"
