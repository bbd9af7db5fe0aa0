#!/usr/bin/env bash
# One device call: the test suite on the GPU, the op benchmarks, and training throughput.
# Run from the repository root on the GPU machine: bash bench/gpu_run.sh  (writes logs to $OUT)
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
timeout "$TEST_TIMEOUT" python3 -m pytest -q -n 8 -p no:cacheprovider tests --maxfail=50 > "$OUT/tests.log" 2>&1
echo "pytest exit: $?"; tail -45 "$OUT/tests.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=src:/tmp/site
fi
timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_ops.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20
