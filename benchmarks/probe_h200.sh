#!/usr/bin/env bash
# Row D: the longest sequence each side trains one full step at (8 layers, micro-batch 1, no
# attention mask, activation checkpointing on), one fresh process per length, 1024-token steps.
# One side per call keeps each call under 10 minutes:
#
#   SIDE=hf OUT=/some/dir bash benchmarks/probe_h200.sh
#   SIDE=moetune OUT=/some/dir bash benchmarks/probe_h200.sh
# START (default 16384), MAX, BUDGET_S (no new length after it, default 420 s), EXTRA (more flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
SIDE="${SIDE:?set SIDE=hf or SIDE=moetune}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOETUNE_COMMIT="${MOETUNE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/probe_h200_${SIDE}.log") 2>&1
timeout 570 python -m moetune.bench --probe-max-seq --sides "$SIDE" --layers 8 --routing real \
  --activation-checkpointing on --probe-start "${START:-16384}" --probe-step 1024 \
  --probe-max "${MAX:-262144}" --probe-timeout 240 --probe-budget "${BUDGET_S:-420}" --out "$OUT" ${EXTRA:-}
