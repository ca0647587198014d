#!/usr/bin/env bash
# Two H200s: Transformers v5 with FSDP2 on every decoder layer (no EP) vs moetune with expert
# parallelism (ep_size = 2), 16 layers, seq 4096, micro-batch 1, real and balanced routing.
# Reports tokens/s/GPU; results under $OUT (default benchmarks/results).
#
#   OUT=/some/dir bash benchmarks/run_h200x2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
NPROC="${NPROC:-2}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOETUNE_COMMIT="${MOETUNE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run_h200x${NPROC}.log") 2>&1
status=0
marker="$(mktemp)"

echo "== $(date -u +%FT%TZ) commit $MOETUNE_COMMIT"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
nvidia-smi topo -m || true

echo "== ${NPROC} GPUs: 16 layers, seq 4096, mb 1, real + balanced"
timeout 480 torchrun --standalone --nproc-per-node "$NPROC" -m moetune.bench --out "$OUT" \
  --layers "${LAYERS:-16}" --seq-len 4096 --micro-batch 1 --routing both ${EXTRA:-} || status=1

echo "== summary"
mapfile -t results < <(find "$OUT" -maxdepth 1 -name '*.json' -newer "$marker")
if (( ${#results[@]} )); then python -m moetune.bench --summarize "${results[@]}" || status=1; fi
exit $status
