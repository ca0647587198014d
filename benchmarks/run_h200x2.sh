#!/usr/bin/env bash
# Two H200s: Transformers v5 with FSDP2 on every decoder layer (no EP) vs moetune with expert
# parallelism (ep_size = 2), 16 layers, seq 4096, micro-batch 1, real and balanced routing
# (rows B and C), plus the checks and one-GPU references around them. Results under $OUT
# (default benchmarks/results).
#
#   OUT=/some/dir bash benchmarks/run_h200x2.sh
#   STAGES picks stages (default: parity rowB); the others:
#     parity     EP bf16 parity vs one process, plain and pipelined dispatchers (benchmarks/ep_parity.py)
#     rowB       both sides, gradients reduced in bf16, moetune with EP_CHUNKS (default 1: no pipelining) chunks
#     chunks     moetune alone with 1, 2 and 4 chunks (the pipelined dispatcher's effect)
#     onegpu16l  moetune alone on GPU 0 at 16 layers, eager and graphed (the 90% reference;
#                ONEGPU_MODES=graph: graphed only)
#     paritygraph  EP bf16 parity with ep_dispatch=allgather + dense_parallel=replicate, and CUDA-graph
#                replays of that step equal to its eager step (benchmarks/ep_parity.py --cuda-graph;
#                with the updates during the backward; PARITY_EXTRA= (empty): without; PARITY_DISPATCH: another
#                ep_dispatch)
#     rowBgraph  rows B and C with moetune's expert-parallel step captured in CUDA graphs (all-gather
#                dispatcher, replicated non-expert parameters, updates during the backward),
#                Transformers + FSDP2 measured alongside
#     rowBag     moetune alone, the same options, eager (what the graph saves)
#     profileep  the graphed expert-parallel step's GPU timeline per rank (benchmarks/profile_ep.py:
#                compute-busy, NCCL-busy and exposed NCCL time; traces under $OUT/profile_ep;
#                with the updates during the backward; PROFILE_EXTRA, PROFILE_LABEL for variants)
#     envsweep   row B's moetune side alone (real routing), once per setting of ENV_SWEEP ("-" = as is;
#                e.g. ENV_SWEEP="- NCCL_MAX_NCHANNELS=8 A=1,B=2": commas join the variables of one setting)
#     optsweep   row B's moetune side alone (real routing), once per set of moetune options in OPT_SWEEP ("-" =
#                defaults; e.g. OPT_SWEEP="- replicate_bucket_mb=None replicate_bucket_mb=25,replicate_max_ctas=8")
#     lora       LoRA (rank 16, attention projections + every expert): Transformers + PEFT + FSDP2 against
#                moetune.lora with ep=NPROC + FSDP2, eager, real routing (never run on GPUs before)
#     ncclprobe  the all-gather dispatcher's per-layer collectives alone (benchmarks/probes/nccl_probe.py): NCCL,
#                and copy-engine pushes into symmetric memory (--copy-engine)
#     otherarch  rows B and C's setting for the other architectures, real routing, moetune eager with the
#                all-gather dispatcher and replicated dense parameters: Nemotron 3 Nano and Moonlight-16B-A3B
#                (DeepSeek-V3's architecture) at 16 layers, GPT-OSS-20B at 12
#     otherarchgraph  the same, moetune's step replayed from CUDA graphs with the updates in the backward
#                (OTHERARCH_SPECS="config:layers ...": a subset, e.g. "nemotron_3_nano_30b_a3b:16")
#     quackep    quack's experts under expert parallelism (needs `source benchmarks/install_quack.sh` first):
#                bf16 parity of the all-to-all dispatcher (quack tuning once per row bucket), then
#                moetune alone, real routing, eager: all-to-all and all-gather dispatchers
#     recipe     `moetune finetune`'s own tokens/s, eager and with training.cuda_graph, on one GPU (8 layers)
#                and on two (16 layers, ep=2) (benchmarks/recipe_probe.py; packed synthetic chat rows)
#                RECIPE_CONFIG=nemotron_3_nano_30b_a3b (or another shipped bench config): another architecture
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
NPROC="${NPROC:-2}"
EP_CHUNKS="${EP_CHUNKS:-1}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOETUNE_COMMIT="${MOETUNE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run_h200x${NPROC}.log") 2>&1
status=0
marker="$(mktemp)"
STAGES=" ${STAGES:-parity rowB} "
stage() { [[ "$STAGES" == *" $1 "* ]]; }
# has_quack: whether quack-kernels imports (the quack stages need it: benchmarks/install_quack.sh);
# says so and marks the run failed when it does not, instead of timing rows that fail to build
has_quack() {
  python -c "import quack" 2>/dev/null && return 0
  echo "skipped: quack-kernels does not import here (source benchmarks/install_quack.sh in this call first)"
  status=1; return 1
}
bench2() {  # bench2 SECONDS ARGS...: moetune.bench under torchrun on NPROC GPUs
  # shellcheck disable=SC2086
  timeout "$1" torchrun --standalone --nproc-per-node "$NPROC" -m moetune.bench --out "$OUT" --layers "${LAYERS:-16}" \
    --seq-len 4096 --micro-batch 1 "${@:2}" ${EXTRA:-} || status=1
}

echo "== $(date -u +%FT%TZ) commit $MOETUNE_COMMIT stages:$STAGES"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
nvidia-smi topo -m || true

if stage parity; then
  for chunks in 1 2; do
    echo "== EP parity, ep_overlap_chunks=$chunks"
    timeout 150 torchrun --standalone --nproc-per-node "$NPROC" benchmarks/ep_parity.py --ep-overlap-chunks "$chunks" \
      2>&1 | grep -E "RESULT|Error|error" || status=1
  done
fi

if stage rowB; then
  echo "== rows B, C: ${NPROC} GPUs, ${LAYERS:-16} layers, real + balanced, bf16 gradient reduction, $EP_CHUNKS chunks"
  bench2 300 --routing both --moetune-option reduce_dtype=bfloat16 --moetune-option "ep_overlap_chunks=$EP_CHUNKS" \
    --moetune-optimizer moetune
fi

if stage lora; then
  echo "== LoRA rank 16: ${NPROC} GPUs, ${LAYERS:-16} layers, Transformers + PEFT + FSDP2 vs moetune ep=${NPROC} + FSDP2"
  bench2 240 --routing real --lora-rank 16
fi

GRAPHABLE_EP=(--moetune-option ep_dispatch=allgather --moetune-option dense_parallel=replicate --moetune-optimizer moetune)
if stage paritygraph; then
  echo "== EP parity, all-gather dispatcher + replicated dense parameters, CUDA-graph replays"
  timeout 200 torchrun --standalone --nproc-per-node "$NPROC" benchmarks/ep_parity.py --ep-dispatch "${PARITY_DISPATCH:-allgather}" \
    --dense-parallel replicate --cuda-graph ${PARITY_EXTRA---overlap-optimizer} 2>&1 | grep -E "RESULT|graph replay|Error|error" || status=1
fi

if stage otherarch; then
  echo "== other architectures: ${NPROC} GPUs, Transformers + FSDP2 vs moetune ep=${NPROC} (eager), real routing"
  for spec in ${OTHERARCH_SPECS:-nemotron_3_nano_30b_a3b:16 moonlight_16b_a3b:16 gpt_oss_20b:12}; do
    LAYERS="${spec#*:}" bench2 170 --config "${spec%%:*}" --routing real "${GRAPHABLE_EP[@]}"
  done
fi

if stage otherarchgraph; then
  echo "== other architectures: ${NPROC} GPUs, Transformers + FSDP2 vs moetune ep=${NPROC} (graphed), real routing"
  for spec in ${OTHERARCH_SPECS:-nemotron_3_nano_30b_a3b:16 moonlight_16b_a3b:16 gpt_oss_20b:12}; do
    LAYERS="${spec#*:}" bench2 170 --config "${spec%%:*}" --routing real --moetune-cuda-graph --moetune-overlap-optimizer \
      "${GRAPHABLE_EP[@]}"
  done
fi

if stage rowBgraph; then
  echo "== rows B, C: ${NPROC} GPUs, ${LAYERS:-16} layers, moetune's EP step replayed from CUDA graphs"
  bench2 360 --routing both --moetune-cuda-graph --moetune-overlap-optimizer "${GRAPHABLE_EP[@]}"
fi

if stage envsweep; then  # ENV_SWEEP="- NAME=1 NAME=2": row B's moetune side alone (real routing) per setting
  for setting in ${ENV_SWEEP:--}; do
    echo "== moetune alone, graphed EP, environment: $setting"
    ( if [[ "$setting" != - ]]; then IFS=, read -ra assignments <<< "$setting"; export "${assignments[@]}"; fi
      bench2 150 --routing real --sides moetune --moetune-cuda-graph --moetune-overlap-optimizer "${GRAPHABLE_EP[@]}" ) || status=1
  done
fi

if stage optsweep; then  # OPT_SWEEP="- replicate_bucket_mb=None a=1,b=2": row B's moetune side alone per option set
  for setting in ${OPT_SWEEP:--}; do
    echo "== moetune alone, graphed EP, options: $setting"
    flags=()
    if [[ "$setting" != - ]]; then IFS=, read -ra assignments <<< "$setting"
      for assignment in "${assignments[@]}"; do flags+=(--moetune-option "$assignment"); done; fi
    bench2 150 --routing real --sides moetune --moetune-cuda-graph --moetune-overlap-optimizer "${GRAPHABLE_EP[@]}" "${flags[@]}" \
      || status=1
  done
fi

if stage quackep && has_quack; then
  echo "== quack experts under EP: parity (all-to-all), then tokens/s per dispatcher"
  timeout 200 torchrun --standalone --nproc-per-node "$NPROC" benchmarks/ep_parity.py --option experts_backend=quack \
    2>&1 | grep -E "RESULT|Error|error" || status=1
  for dispatch in alltoall allgather; do
    echo "== moetune alone, experts_backend=quack, ep_dispatch=$dispatch, eager"
    bench2 300 --routing real --sides moetune --moetune-optimizer moetune --moetune-option experts_backend=quack \
      --moetune-option "ep_dispatch=$dispatch"
  done
fi

if stage rowBag; then
  echo "== moetune alone, all-gather dispatcher + replicated dense parameters, eager"
  bench2 200 --routing both --sides moetune "${GRAPHABLE_EP[@]}"
fi

if stage profileep; then
  echo "== graphed expert-parallel step, GPU timeline"
  timeout 150 torchrun --standalone --nproc-per-node "$NPROC" benchmarks/profile_ep.py --layers "${LAYERS:-16}" \
    --option ep_dispatch=allgather --option dense_parallel=replicate --cuda-graph --overlap-optimizer --out "$OUT/profile_ep" \
    --label "$MOETUNE_COMMIT${PROFILE_LABEL:-}" ${PROFILE_EXTRA:-} 2>&1 | grep -vi warn | tail -40 || status=1
fi

if stage ncclprobe; then
  echo "== the all-gather dispatcher's collectives alone"
  timeout 90 torchrun --standalone --nproc-per-node "$NPROC" benchmarks/probes/nccl_probe.py --copy-engine --out "$OUT/nccl_probe.jsonl" \
    2>&1 | grep case || status=1
fi

if stage chunks; then
  for chunks in 1 4; do
    echo "== moetune alone, ep_overlap_chunks=$chunks"
    bench2 150 --routing both --sides moetune --moetune-option reduce_dtype=bfloat16 \
      --moetune-option "ep_overlap_chunks=$chunks" --moetune-optimizer moetune
  done
fi

if stage onegpu16l; then
  echo "== moetune alone on one GPU, ${LAYERS:-16} layers, eager then graphed"
  for mode in ${ONEGPU_MODES:-eager graph}; do
    graph=""; [[ "$mode" == graph ]] && graph="--moetune-cuda-graph --moetune-overlap-optimizer"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 timeout 150 python -m moetune.bench --out "$OUT" --layers "${LAYERS:-16}" --seq-len 4096 \
      --micro-batch 1 --routing both --sides moetune --moetune-optimizer moetune $graph ${EXTRA:-} || status=1
  done
fi

if stage recipe; then  # the recipe's own tokens/s (benchmarks/recipe_probe.py): one GPU at 8 layers, two at 16 with ep=2
  echo "== recipe: one GPU, 8 layers, eager and graphed"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/recipe_probe.py --layers 8 --variants eager,graph \
    --model-config "${RECIPE_CONFIG:-qwen3_30b_a3b}" --timeout 90 --work /tmp/recipe_probe_1gpu --out "$OUT" || status=1
  echo "== recipe: two GPUs, 16 layers, ep=2 (all-gather + replicate), eager and graphed"
  timeout 220 python benchmarks/recipe_probe.py --layers 16 --nproc 2 --ep 2 --variants eager,graph \
    --model-config "${RECIPE_CONFIG:-qwen3_30b_a3b}" --timeout 100 --work /tmp/recipe_probe_2gpu --out "$OUT" || status=1
fi

echo "== summary"
mapfile -t results < <(find "$OUT" -maxdepth 1 -name '*.json' -newer "$marker")
if (( ${#results[@]} )); then python -m moetune.bench --summarize "${results[@]}" || status=1; fi
exit $status
