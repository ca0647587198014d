#!/usr/bin/env bash
# The user scripts on one GPU, both imports side by side, in one call (OUT: a folder for the results).
#
#   OUT=/some/dir bash benchmarks/user_scripts/run_gpu.sh
#   STAGES="tests qwen3" SCRIPTS=trainer_rows,sft_packing LAYERS=8 OUT=... bash benchmarks/user_scripts/run_gpu.sh
#
# Stages: tests (the GPU tests of the graphed training step and moetune.Trainer), qwen3 (every user
# script on Qwen3-30B-A3B shapes), bench (moetune bench's graphed step, the reference of script 5,
# without clipping and with max_grad_norm 1.0 as the Trainer clips; each BENCH_TIMEOUT),
# families (scripts 1-3 on the other shipped configs), family_bench (moetune bench's eager step of
# each of those configs at FAMILY_LAYERS with torch's AdamW on both sides: the ratio the families'
# script 1 is held to; then again under autocast with the Trainer's clipping, as script 1 trains:
# FAMILY_BENCH_MODES="plain like_the_script" selects them). A stage's failure does not stop the next.
# Wheels for packages the machine lacks (trl, datasets, ...) are installed from $WHEELS if set.
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
STAGES=${STAGES:-"tests qwen3 bench"}
LAYERS=${LAYERS:-8}
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-15}
SCRIPTS=${SCRIPTS:-trainer_rows,trainer_rows_moetune_trainer,sft_packing,sft_lora,sft_padded,sft_padding_free,trainer_rows_compile}
FAMILY_SCRIPTS=${FAMILY_SCRIPTS:-trainer_rows,sft_packing}
FAMILY_LAYERS=${FAMILY_LAYERS:-4}
RESULTS=${RESULTS:-/tmp/user_scripts_results}
# PROFILE_STEP: one measured step of every script (qwen3 and families stages) run under torch.profiler:
# the GPU's busy and idle time and the kernels by GPU time in each side's JSON ("profile").
PROFILE=(); [ -n "${PROFILE_STEP:-}" ] && PROFILE=("--extra=--profile-step=$PROFILE_STEP")
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, accelerate, peft, trl, datasets, pyarrow; print(torch.__version__, transformers.__version__, accelerate.__version__, peft.__version__, trl.__version__, datasets.__version__, pyarrow.__version__)"
} 2>&1 | tee "$RESULTS/environment.txt"

for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    tests)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_graphed_training.py -p no:cacheprovider -rA 2>&1 | tee "$RESULTS/gpu_tests_full.log" | tail -30 | tee "$RESULTS/gpu_tests.log" ;;
    qwen3)
      timeout ${QWEN3_TIMEOUT:-480} python3 benchmarks/user_scripts/compare.py --config qwen3_30b_a3b --layers "$LAYERS" \
        --scripts "$SCRIPTS" --max-steps "$STEPS" --warmup-steps "$WARMUP" --out "$RESULTS/qwen3" --work /tmp/us_work_qwen3 \
        --timeout ${SIDE_TIMEOUT:-150} "${PROFILE[@]}" 2>&1 | grep -v "it/s\]" | tail -40 | tee "$RESULTS/qwen3.log" ;;
    # bench: without clipping, and with the Trainer's default max_grad_norm (script 5's update)
    bench)
      for clip in "" "--max-grad-norm 1.0"; do
        timeout ${BENCH_TIMEOUT:-100} python3 -m moetune.bench --layers "$LAYERS" --routing real --sides moetune --moetune-cuda-graph \
          --moetune-optimizer moetune --steps 10 --warmup 3 $clip --out "$RESULTS/bench" 2>&1 | tail -8 | tee -a "$RESULTS/bench.log"
      done ;;
    families)
      for config in gpt_oss_20b nemotron_3_nano_30b_a3b moonlight_16b_a3b; do
        timeout ${FAMILY_TIMEOUT:-200} python3 benchmarks/user_scripts/compare.py --config $config --layers "$FAMILY_LAYERS" \
          --scripts "$FAMILY_SCRIPTS" --max-steps 30 --warmup-steps 12 --out "$RESULTS/$config" --work /tmp/us_work_$config \
          --timeout 120 "${PROFILE[@]}" 2>&1 | grep -v "it/s\]" | tail -12 | tee "$RESULTS/$config.log"
        rm -rf /tmp/us_work_$config
      done ;;
    # family_bench: the bench's default step, then the script's (autocast, the Trainer's clipping)
    family_bench)
      for config in gpt_oss_20b nemotron_3_nano_30b_a3b moonlight_16b_a3b; do
        for mode in ${FAMILY_BENCH_MODES:-plain like_the_script}; do
          case $mode in plain) extra="" ;; like_the_script) extra="--autocast --max-grad-norm 1.0" ;; esac
          timeout ${FAMILY_BENCH_TIMEOUT:-75} python3 -m moetune.bench --config $config --layers "$FAMILY_LAYERS" --routing real \
            --moetune-optimizer torch --steps 10 --warmup 3 $extra --out "$RESULTS/family_bench" 2>&1 | tail -6 \
            | tee -a "$RESULTS/family_bench.log"
        done
      done ;;
  esac
  echo "stage $stage: $(( $(date +%s) - start )) s" | tee -a "$RESULTS/stages.txt"
done
# What comes back: at most 8 files; the JSON results and logs in one archive, the main JSON beside it.
cp "$RESULTS"/qwen3/user_scripts_*.json "$RESULTS"/bench/*.json "$OUT"/ 2>/dev/null
tar czf "$OUT/user_scripts_results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
cp "$RESULTS/stages.txt" "$OUT"/ 2>/dev/null
ls -la "$OUT"
