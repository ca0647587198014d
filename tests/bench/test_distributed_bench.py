"""``torchrun -m moetune.bench`` on CPU with gloo: Transformers + FSDP2 vs moetune + expert parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_both_sides(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moetune.bench",
        "--config", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--routing", "balanced",
        "--device", "cpu", "--no-chart", "--out", str(tmp_path), "--moetune-rebalance-experts",
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("tiny-3l_2xcpu_*.json")
    data = json.loads(path.read_text())
    assert data["world_size"] == 2
    assert "FSDP2" in data["built"]["hf"]["sharding"] and "ep_size=2" in data["built"]["moetune"]["sharding"]
    assert data["built"]["moetune"]["sharded_weights_match"] is True
    assert all(r["error"] is None and r["tokens_per_s_per_gpu"] > 0 for r in data["rows"])
    # The experts relabelled for balanced ranks, counted with the real router (the row runs the balanced gate).
    placement = data["built"]["moetune"]["expert_placement"]
    assert placement["num_ranks"] == 2 and data["config"]["moetune_rebalance_experts"] is True
    assert 1.0 <= placement["busiest_rank_over_mean_after"] <= placement["busiest_rank_over_mean_before"]
    assert placement["busiest_rank_over_mean_before"] > 1.0


def test_two_ranks_lora(tmp_path):
    """``--lora-rank`` under torchrun: PEFT's adapters before FSDP2 on Transformers' side (its expert
    wrapper one unit with the experts), moetune's between expert parallelism and FSDP2
    (``from_config(lora=...)``), the same adapter values: equal trainable parameters and first losses."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moetune.bench",
        "--config", "tiny", "--layers", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--routing", "real",
        "--lora-rank", "4", "--device", "cpu", "--no-chart", "--out", str(tmp_path),
    ]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = tmp_path.glob("tiny-2l_2xcpu_*.json")
    data = json.loads(path.read_text())
    built = data["built"]
    assert built["hf"]["lora"].startswith("peft") and "FSDP2" in built["hf"]["sharding"]
    assert "from_config(lora=" in built["moetune"]["lora"] and "ep_size=2" in built["moetune"]["sharding"]
    assert built["moetune"]["sharded_weights_match"] is True  # the adapters drawn like every weight
    assert built["hf"]["trainable_parameters"] == built["moetune"]["trainable_parameters"] > 0
    assert all(r["error"] is None and r["tokens_per_s_per_gpu"] > 0 for r in data["rows"])
    losses = {r["side"]: r["losses"] for r in data["rows"]}
    assert abs(losses["hf"][0] - losses["moetune"][0]) < 0.02
