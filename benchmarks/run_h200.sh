#!/usr/bin/env bash
# moetune vs Transformers v5 on one H200 (or GPU 0 of a larger machine), in one call (~7 minutes):
#   1. versions and nvidia-smi
#   2. correctness first: bf16 parity of loss, logits and gradients against an fp32 reference
#      (2-layer Qwen3-30B-A3B shapes, seq 1024, real routing)
#   3. row A: 8 layers, seq 4096, micro-batch 1, real and balanced routing; moetune with its own
#      AdamW kernel, then moetune with torch's fused AdamW (the strict like-for-like optimizer)
#   4. moetune alone at 16 layers (the one-GPU reference for the two-GPU row B)
#   5. row D: longest sequence, activation checkpointing on, 16k-token steps around the known
#      limits (Transformers: 49,152 fits, 65,536 does not, per the brief; moetune from 98,304)
#   6. a compact table of every result file, printed last
# Results (JSON + PNG per run, and this log) go to $OUT (default benchmarks/results).
# STAGES picks stages (default: versions parity rowA strict 16l rowD); the others:
#   gputests  every GPU-marked test (CUDA-graph step, optimizer, loss kernels, kernels, gathered experts,
#             document attention, the graphed recipe, LoRA, fallback models' experts, the four families'
#             bf16 parity)
#   lora      LoRA fine-tuning (rank 16, attention projections + every expert): Transformers + PEFT
#             against moetune.lora, moetune graphed; Qwen3 (8 layers, both routings), GPT-OSS-20B (6),
#             Nemotron 3 Nano (8), Moonlight-16B-A3B (8)
#   graph     row A with moetune's step replayed from CUDA graphs, updates during the backward
#             (--moetune-cuda-graph --moetune-overlap-optimizer)
#   graphtriton  moetune alone, graphed, with experts_backend=triton (Triton row GEMMs)
#   quack     row A graphed with experts_backend=quack (both sides), moetune's default in the same call,
#             and both at 16 layers (needs quack-kernels: benchmarks/install_quack.sh)
#   quackothers  GPT-OSS-20B (6 layers) and Nemotron 3 Nano (8), moetune alone, graphed, with
#             experts_backend=quack then the default (needs quack-kernels)
#   quackpad  the recipe (8 layers, eager) on unpacked samples of 200-3,000 tokens, one per step:
#             torch's grouped GEMM, then quack (a new row count every step) (needs quack-kernels)
#   graph16l  moetune alone at 16 layers, eager and graphed (the one-GPU reference of row B)
#   profile   benchmarks/profile_step.py: kernels and GPU idle time of one step, eager and graphed
#   nemotron  Nemotron 3 Nano: one Mamba-2 mixer, Transformers' torch path vs moetune's
#             (benchmarks/probes/mamba2_probe.py), then 8 layers of the model side by side (real routing)
#   othermodels  GPT-OSS-20B (6 layers: both sides' eager attention keeps [heads, S, S] scores) and
#             Moonlight-16B-A3B (DeepSeek-V3's architecture, 8 layers) side by side, real routing
#   othermodelsgraph  the same with moetune's step replayed from CUDA graphs, updates in the backward
#
#   OUT=/some/dir bash benchmarks/run_h200.sh
#   STAGES="versions gputests graph profile" OUT=/some/dir bash benchmarks/run_h200.sh
#   BUDGET_S=330: rows B and C start only before this many seconds; LIMIT_S=570: hard stop
#   EXTRA="--config tiny --device cpu --steps 2 --warmup 1": extra flags for every run (smoke test)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
BUDGET_S="${BUDGET_S:-330}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOETUNE_COMMIT="${MOETUNE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run_h200.log") 2>&1
LIMIT_S="${LIMIT_S:-570}"   # the whole script stays under this (a device call allows 600 s)
status=0
marker="$(mktemp)"
# bench SECONDS ARGS...: one python -m moetune.bench, killed after SECONDS or at the overall limit
bench() {
  local t=$(( $1 < LIMIT_S - SECONDS ? $1 : LIMIT_S - SECONDS ))
  if (( t < 30 )); then echo "skipped (${SECONDS}s elapsed): ${*:2}"; status=1; return; fi
  # shellcheck disable=SC2086  # EXTRA is a list of extra flags (e.g. a CPU smoke test: --config tiny --device cpu)
  timeout "$t" python -m moetune.bench --out "$OUT" "${@:2}" ${EXTRA:-} || status=1
}

STAGES=" ${STAGES:-versions parity rowA strict 16l rowD} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
# has_quack: whether quack-kernels imports (the quack stages need it: benchmarks/install_quack.sh);
# says so and marks the run failed when it does not, instead of timing rows that fail to build
has_quack() {
  python -c "import quack" 2>/dev/null && return 0
  echo "skipped: quack-kernels does not import here (source benchmarks/install_quack.sh in this call first)"
  status=1; return 1
}

echo "== $(date -u +%FT%TZ) commit $MOETUNE_COMMIT stages:$STAGES"
if stage versions; then
python - <<'PY'
import platform, torch, transformers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
print(f"python {platform.python_version()} torch {torch.__version__} (cuda {torch.version.cuda}) "
      f"transformers {transformers.__version__} triton {tv}")
print("gpus:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
nvidia-smi || true
fi

if stage gputests; then
  echo "== GPU tests"
  # every GPU-marked test (the marker selects them; collecting the CPU ones costs seconds)
  timeout 300 python -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests || status=1
fi

if stage lora; then
  echo "== LoRA, rank 16: Transformers + PEFT against moetune.lora (moetune's step graphed)"
  bench 150 --layers 8 --seq-len 4096 --routing both --lora-rank 16 --moetune-cuda-graph
  bench 150 --config gpt_oss_20b --layers 6 --seq-len 4096 --routing real --lora-rank 16 --moetune-cuda-graph
  bench 150 --config nemotron_3_nano_30b_a3b --layers 8 --seq-len 4096 --routing real --lora-rank 16 --moetune-cuda-graph
  bench 150 --config moonlight_16b_a3b --layers 8 --seq-len 4096 --routing real --lora-rank 16 --moetune-cuda-graph
fi

if stage nemotron; then
  echo "== Nemotron 3 Nano: one Mamba-2 mixer, then 8 layers side by side"
  timeout 150 python benchmarks/probes/mamba2_probe.py --seq-len 4096 --out "$OUT/mamba2_probe_h200.jsonl" || status=1
  bench 240 --config nemotron_3_nano_30b_a3b --layers 8 --seq-len 4096 --micro-batch 1 --routing real --moetune-optimizer moetune
fi

if stage othermodels; then
  echo "== GPT-OSS-20B (6 layers) and Moonlight-16B-A3B (8 layers), side by side"
  bench 200 --config gpt_oss_20b --layers 6 --seq-len 4096 --micro-batch 1 --routing real --moetune-optimizer moetune
  bench 200 --config moonlight_16b_a3b --layers 8 --seq-len 4096 --micro-batch 1 --routing real --moetune-optimizer moetune
fi

if stage othermodelsgraph; then
  echo "== GPT-OSS-20B (6 layers) and Moonlight-16B-A3B (8 layers), moetune's step replayed from CUDA graphs"
  bench 200 --config gpt_oss_20b --layers 6 --seq-len 4096 --micro-batch 1 --routing real --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer
  bench 200 --config moonlight_16b_a3b --layers 8 --seq-len 4096 --micro-batch 1 --routing real --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer
fi

if stage parity; then
  echo "== parity (correctness before timing)"
  bench 150 --parity-only --parity-layers 2 --parity-seq-len 1024 --parity-routing real
fi

if stage profile; then
  echo "== profile of one step, eager and graphed (8 layers, real routing)"
  timeout 200 python benchmarks/profile_step.py --layers 8 --sides moetune+adamw,moetune+graph --profile --top 45 \
    2>&1 | tee "$OUT/profile_graph_h200.txt" || status=1
fi

if stage rowA; then
  echo "== row A: 8 layers, seq 4096, mb 1, real + balanced; moetune AdamW kernel"
  bench 150 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --moetune-optimizer moetune
fi

if stage graph; then
  echo "== row A, moetune's step replayed from CUDA graphs (Transformers side measured in the same run)"
  bench 150 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --moetune-optimizer moetune --moetune-cuda-graph \
    --moetune-overlap-optimizer
fi

if stage graphtriton; then
  echo "== row A graphed, moetune alone with the Triton experts GEMMs (experts_backend=triton)"
  bench 120 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-option experts_backend=triton
fi

if stage strict; then
  echo "== row A, strict optimizer: moetune with torch's fused AdamW"
  bench 90 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer torch
fi

if stage 16l; then
  echo "== moetune alone, 16 layers (one-GPU reference for row B)"
  bench 90 --layers 16 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune
fi

if stage quack && has_quack; then
  # needs quack-kernels (benchmarks/install_quack.sh)
  echo "== row A graphed, both sides, moetune with quack's grouped GEMMs (experts_backend=quack)"
  bench 170 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --moetune-optimizer moetune --moetune-cuda-graph \
    --moetune-overlap-optimizer --moetune-option experts_backend=quack
  echo "== row A graphed, moetune alone with torch's grouped GEMM (the same call's A/B)"
  bench 100 --layers 8 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer
  echo "== 16 layers graphed, moetune alone, quack then torch's grouped GEMM (one-GPU reference of row B)"
  bench 100 --layers 16 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer --moetune-option experts_backend=quack
  bench 100 --layers 16 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer
fi

if stage quackothers && has_quack; then
  for config in "gpt_oss_20b --layers 6" "nemotron_3_nano_30b_a3b --layers 8"; do
    for option in "--moetune-option experts_backend=quack" ""; do
      echo "== $config, moetune alone, graphed ${option:-(default experts backend)}"
      # shellcheck disable=SC2086  # config and option are lists of flags
      bench 240 --config $config --seq-len 4096 --micro-batch 1 --routing real --sides moetune --moetune-optimizer moetune \
        --moetune-cuda-graph --moetune-overlap-optimizer $option
    done
  done
fi

if stage quackpad && has_quack; then
  echo "== the recipe on unpacked samples of varying length: grouped_mm, then quack"
  common=(--layers 8 --variants eager --steps 24 --skip-steps 8 --log-every 4 --override data.packing=false)
  # quack tunes once per power-of-two row bucket (quack_grouped_gemm.TunedConfigs): ~50 s per bucket
  # for a Qwen3 layer's six GEMMs, three buckets for these samples, before its steps run at speed
  timeout 140 python benchmarks/recipe_probe.py "${common[@]}" --timeout 100 --out "$OUT/quackpad_grouped_mm" || status=1
  timeout 340 python benchmarks/recipe_probe.py "${common[@]}" --timeout 300 --override model.experts_backend=quack \
    --out "$OUT/quackpad_quack_unpadded" || status=1
fi

if stage graph16l; then
  echo "== moetune alone, 16 layers, graphed (one-GPU reference for row B)"
  bench 90 --layers 16 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune \
    --moetune-cuda-graph --moetune-overlap-optimizer
fi

if stage rowD; then
echo "== row D: longest sequence (AC on, real routing)"
bench 120 --probe-max-seq --sides hf --layers 8 --routing real --activation-checkpointing on \
  --probe-start 49152 --probe-step 16384 --probe-max 65536 --probe-search linear --probe-timeout 110
bench 150 --probe-max-seq --sides moetune --layers 8 --routing real --activation-checkpointing on \
  --probe-start 98304 --probe-step 32768 --probe-max 163840 --probe-search linear --probe-timeout 110
fi

echo "== summary (${SECONDS}s)"
mapfile -t results < <(find "$OUT" -maxdepth 1 -name '*.json' -newer "$marker" -printf '%T@ %p\n' | sort -n | cut -d' ' -f2-)
if (( ${#results[@]} )); then python -m moetune.bench --summarize "${results[@]}" || status=1; fi
exit $status
