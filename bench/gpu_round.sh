#!/usr/bin/env bash
# One device call between rounds of work: the GPU test suite, then the benches named on the
# command line (each "name:timeout:command"). Logs go to $OUT; the summary to stdout.
# The benches keep tuning choices and Triton's compiled kernels in .device-cache/ (git-ignored),
# packed into $OUT/device-cache.tgz at the end: copy it to .device-cache/pack.tgz here and name
# .device-cache in the next call's carry (packed: the kernels unpacked outgrow what travels),
# and that call neither tunes nor compiles again.
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
CACHE=$PWD/.device-cache
mkdir -p "$OUT" "$CACHE"
if [ -f "$CACHE/pack.tgz" ]; then tar xzf "$CACHE/pack.tgz" -C "$PWD" && rm "$CACHE/pack.tgz"; fi
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v -n 14 -p no:cacheprovider --timeout 150 ${TEST_PATHS:-tests} --maxfail=60 \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?"; grep -E " passed| failed|FAILED|ERROR" "$OUT/tests.log" | grep -v "^$" | tail -60
fi
export TEENY_TUNING_CACHE=$CACHE/tuning.json TRITON_CACHE_DIR=$CACHE/triton
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  echo "== $name exit $? in $(( $(date +%s) - start )) s"
done
if [ $# -gt 0 ]; then
  tar czf "$OUT/device-cache.tgz" -C "$PWD" .device-cache
  if [ "$(stat -c %s "$OUT/device-cache.tgz")" -gt 15000000 ]; then  # over what comes back: tuning alone
    tar czf "$OUT/device-cache.tgz" -C "$PWD" .device-cache/tuning.json
  fi
  echo "device cache: $(du -sh "$OUT/device-cache.tgz" | cut -f1)"
fi
