#!/usr/bin/env bash
# One device call between rounds of work: the GPU test suite, then the benches named on the
# command line (each "name:timeout:command"). Logs go to $OUT; the summary to stdout.
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v -n 14 -p no:cacheprovider --timeout 150 ${TEST_PATHS:-tests} --maxfail=60 \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?"; grep -E " passed| failed|FAILED|ERROR" "$OUT/tests.log" | grep -v "^$" | tail -60
fi
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  echo "== $name exit $? in $(( $(date +%s) - start )) s"
done
