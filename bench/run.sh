#!/usr/bin/env bash
# The one device runner: optionally the GPU test suite, then the named benches, each under its own
# time limit, one after another; a bench that fails or runs out of time does not stop the others.
# Run from the repository root on the GPU machine:
#
#     bash bench/run.sh ops                                        # bench/ops.py, default limit
#     bash bench/run.sh "ops:300:--area memory products" "steps:240:--models gpt6,mlp"
#     bash bench/run.sh "sweep:120:python3 bench/tools/matmul_sweep.py --budget 100"
#     TESTS=1 bash bench/run.sh                                    # the GPU test suite alone
#
# A bench is NAME[:SECONDS[:ARGS or COMMAND]]. NAME is a case module (ops, steps, torch_models,
# host, aot), a tool preset (attention, matmul_sweep, loss_sweep, gpu_checks, first_step, train) or any label;
# ARGS starting with "-" are added to the module's command, anything else is the whole command.
# Limits are cut to what is left of BUDGET (seconds, default 540: a 600 s device call with room
# for the start and the packing); a bench that would start with under 20 s left is skipped.
#
# Environment: TESTS=1 runs the GPU suite first (TEST_TIMEOUT, TEST_PATHS, TEST_WORKERS; its log in
# $OUT/tests.log, per file outcomes and the failures in $OUT/tests-summary.txt);
# OUT (default /tmp/out) receives every log, the results files (bench/results/*.csv, each
# the committed file with this run's rows appended: copy them back over bench/results/) and
# device-cache.tgz; BENCH_COMMIT names the commit in the results where the copy has no .git.
# The benches keep tuning choices and Triton's compiled kernels in .device-cache/ (git-ignored),
# packed into $OUT/device-cache.tgz at the end: copy it to .device-cache/pack.tgz here and name
# .device-cache in the next call's carry (packed: the kernels unpacked outgrow what travels), and
# that call neither tunes nor compiles again (tuning is keyed by GPU name: an H100's cache does
# not serve an H200). Liger-Kernel wheels carried in .whl/ are installed first.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-540}
START=$(date +%s)
CACHE=$PWD/.device-cache
mkdir -p "$OUT" "$CACHE"
if [ -f "$CACHE/pack.tgz" ]; then tar xzf "$CACHE/pack.tgz" -C "$PWD" && rm "$CACHE/pack.tgz"; fi
if [ -z "${BENCH_COMMIT:-}" ] && git rev-parse --short HEAD >/dev/null 2>&1; then
  BENCH_COMMIT=$(git rev-parse --short HEAD)
fi
export BENCH_COMMIT=${BENCH_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ "${TESTS:-0}" = 1 ]; then
  limit=${TEST_TIMEOUT:-330}; [ "$limit" -gt "$(left)" ] && limit=$(left)
  # -v: a line per finished test, so a run the limit cuts still says which ran (the rest can be
  # named in TEST_PATHS next time); --durations: the slowest, for a run that finishes
  # each test process compiles ahead in TEENY_COMPILE_WORKERS processes of its own: 2, not one per CPU
  TEENY_COMPILE_WORKERS=${TEENY_COMPILE_WORKERS:-2} timeout "$limit" python3 -m pytest -v -n "${TEST_WORKERS:-14}" -p no:cacheprovider --timeout 150 \
    --durations=30 ${TEST_PATHS:-tests} --maxfail=60 > "$OUT/tests.log" 2>&1
  echo "== tests exit $?"; grep -E " passed| failed|FAILED|ERROR" "$OUT/tests.log" | tail -40
  # per file outcomes and the failures' E lines: what survives a call whose files must stay few
  python3 bench/tools/test_summary.py "$OUT/tests.log" > "$OUT/tests-summary.txt" && cat "$OUT/tests-summary.txt"
fi

export TEENY_TUNING_CACHE=$CACHE/tuning.json TRITON_CACHE_DIR=$CACHE/triton

preset() {  # the command and default limit of a named bench
  case "$1" in
    ops|steps|torch_models|host|aot) echo "300 python3 bench/$1.py" ;;
    attention) echo "200 python3 bench/tools/attention.py --budget 180" ;;
    matmul_sweep|loss_sweep|gpu_checks|tune_launch|dist_overhead) echo "150 python3 bench/tools/$1.py" ;;
    first_step) echo "400 python3 bench/tools/first_step.py examples/bench_llama.py:make_gpu_model --timeout 180 --phases" ;;
    train) echo "300 python3 -m teeny.cli train cnn --no-progress --out $OUT/cnn && \
python3 -m teeny.cli train gpt --size large --epochs 2 --no-progress --out $OUT/gpt" ;;
    *) echo "" ;;
  esac
}

for spec in "$@"; do
  name=${spec%%:*}; rest=""; [ "$spec" != "$name" ] && rest=${spec#*:}
  limit=${rest%%:*}; extra=""; [ "$rest" != "$limit" ] && extra=${rest#*:}
  read -r default cmd <<< "$(preset "$name")"
  if [ -n "$extra" ] && [ "${extra#-}" = "$extra" ]; then cmd=$extra; elif [ -n "$extra" ]; then cmd="$cmd $extra"; fi
  if [ -z "${cmd:-}" ]; then echo "== $name: no such bench and no command given"; continue; fi
  limit=${limit:-$default}; limit=${limit:-300}
  if [ "$(left)" -lt 20 ]; then echo "== $name skipped: $(left) s of the budget left"; continue; fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  status=$?
  echo "== $name exit $status in $(( $(date +%s) - t0 )) s (limit $limit s)$([ $status = 124 ] && echo ': TIMED OUT')"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  mkdir -p "$OUT/results" && cp bench/results/*.csv "$OUT/results/" 2>/dev/null
done

if [ $# -gt 0 ]; then
  tar czf "$OUT/device-cache.tgz" -C "$PWD" .device-cache
  if [ "$(stat -c %s "$OUT/device-cache.tgz")" -gt 15000000 ]; then  # over what comes back: tuning alone
    tar czf "$OUT/device-cache.tgz" -C "$PWD" .device-cache/tuning.json
  fi
  echo "device cache: $(du -sh "$OUT/device-cache.tgz" | cut -f1); results: $(ls "$OUT/results" 2>/dev/null | tr '\n' ' ')"
fi
