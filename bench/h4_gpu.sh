#!/usr/bin/env bash
# One device call for the matrix-product work: the Hopper kernel's tests on the GPU (about 1 min),
# the configuration sweep against cuBLAS (about 4 min), then the issue-9 rows (about 3.5 min);
# each step has a hard timeout, all together under 9.5 minutes. Run from the repository root on
# the GPU machine: bash bench/h4_gpu.sh   (logs, JSON and the tuning cache go to $OUT)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export TEENY_TUNING_CACHE="$OUT/tuning.json"  # the sweep's choices are the rows' choices
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 75 python3 -m pytest -q -x -p no:cacheprovider tests/test_linear.py tests/test_tuning.py \
  -k "tma or hopper or tuning or heuristic or small_products" > "$OUT/tests.log" 2>&1
echo "pytest exit: $?"; tail -4 "$OUT/tests.log"
timeout 250 python3 bench/matmul_sweep.py --budget 190 2>&1 | tee "$OUT/matmul_sweep.log"
timeout 230 python3 bench/issue9_rows.py --budget 150 2>&1 | tee "$OUT/issue9_rows.log"
