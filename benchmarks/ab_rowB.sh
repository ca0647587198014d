#!/usr/bin/env bash
# A/B of two source trees on row B's moetune side (2 GPUs, 16 layers, ep=2, graphed EP step, real and
# balanced routing), alternating A B A B ... so that drift of the machine hits both alike. Each tree
# is a `git archive` tarball; results (bench JSON per run) under $OUT/ab/<label>/, and a table of
# step times per variant at the end.
#
#   git archive --format=tar 8ac19bb -o .snap/a.tar; git archive --format=tar HEAD -o .snap/b.tar
#   OUT=/some/dir ROUNDS=2 bash benchmarks/ab_rowB.sh .snap/a.tar .snap/b.tar
#
# AB_FLAGS replaces the bench flags (a CPU smoke test: AB_FLAGS="--config tiny --device cpu --layers 2
# --seq-len 64 --steps 2 --warmup 1 --routing real --sides moetune --moetune-option ep_dispatch=allgather
# --moetune-option dense_parallel=replicate --moetune-optimizer moetune").
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
ROUNDS="${ROUNDS:-2}"
NPROC="${NPROC:-2}"
FLAGS="${AB_FLAGS:---layers 16 --seq-len 4096 --micro-batch 1 --routing both --sides moetune --moetune-cuda-graph \
--moetune-overlap-optimizer --moetune-option ep_dispatch=allgather --moetune-option dense_parallel=replicate \
--moetune-optimizer moetune}"
(( $# >= 2 )) || { echo "usage: $0 A.tar B.tar [more.tar ...]"; exit 2; }
work="$(mktemp -d)"
labels=()
declare -A commits
for tarball in "$@"; do
  label="$(basename "$tarball" .tar)"
  mkdir -p "$work/$label" "$OUT/ab/$label"
  tar -xf "$tarball" -C "$work/$label" || exit 1
  labels+=("$label")
  # git archive writes the commit into the tarball's header
  commits[$label]="$(git get-tar-commit-id < "$tarball" 2>/dev/null | cut -c1-7)"
  echo "== $label: commit ${commits[$label]:-unknown}"
done
status=0
for round in $(seq "$ROUNDS"); do
  for label in "${labels[@]}"; do
    echo "== round $round: $label"
    # shellcheck disable=SC2086
    (cd "$work/$label" && PYTHONPATH="$work/$label" MOETUNE_COMMIT="${commits[$label]:-$label}" timeout 200 \
      torchrun --standalone --nproc-per-node "$NPROC" -m moetune.bench --out "$OUT/ab/$label" $FLAGS 2>&1 \
      | grep -E "^\[moetune\] .*(tokens/s|error)|Error") || status=1
  done
done
echo "== step ms per variant (every run, then the median)"
for label in "${labels[@]}"; do
  python3 - "$OUT/ab/$label" "$label" <<'PY'
import json, statistics, sys
from pathlib import Path
times = {}
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    for row in json.loads(path.read_text())["rows"]:
        if row.get("step_s"):
            times.setdefault(row["routing"], []).append(row["step_s"] * 1e3)
for routing, values in sorted(times.items()):
    print(f"{sys.argv[2]:>12} {routing:>9}: " + " ".join(f"{v:.1f}" for v in values) + f"  median {statistics.median(values):.1f}")
PY
done
rm -rf "$work"
exit $status
