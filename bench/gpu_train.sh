#!/usr/bin/env bash
# Training on the GPU: the digits CNN to convergence and the larger char GPT for throughput.
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
timeout "${CNN_TIMEOUT:-120}" python3 -m teeny.cli train cnn --no-progress --out "$OUT/cnn" 2>&1 | tail -6
timeout "${GPT_TIMEOUT:-200}" python3 -m teeny.cli train gpt --size large --epochs 2 --no-progress --out "$OUT/gpt" 2>&1 | tail -12
