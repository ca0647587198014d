"""Two nodes of one process each, on this machine (gloo on the CPU): the embedded default job
(shortened as in test_distributed_recipe.py) through two torchrun agents that meet at a c10d
rendezvous on 127.0.0.1, and through examples/slurm_qwen3_30b_a3b.sbatch itself under fake
``srun`` / ``scontrol``. What differs from one node of two processes: both ranks have LOCAL_RANK 0
and LOCAL_WORLD_SIZE 1 < WORLD_SIZE 2, so there are two "local rank 0" processes sharing one
output folder; rank 0 alone must write it, and the losses must be those of one node.

Every process a test starts is killed (its whole tree: torchrun starts its workers in process sessions of
their own) when the test times out or fails."""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from recipe_helpers import REPO, losses, read_metrics, run_concurrently, short_job_args, subprocess_env

pytestmark = pytest.mark.distributed

STEPS = 3
SBATCH = REPO / "examples" / "slurm_qwen3_30b_a3b.sbatch"

FAKE_SRUN = r"""#!/bin/bash
# Fake srun: the command once per node of the allocation, all at once, each with the variables
# Slurm gives a task; when one fails the others are killed (--kill-on-bad-exit); exits with the
# first failure's status.
set -u
echo "$*" >> "$FAKE_SLURM_LOG/srun.args"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done  # srun's own options (all spelled --name=value)
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES \
  SLURM_STEP_NUM_TASKS=$SLURM_NNODES SLURMD_NODENAME=127.0.0.$((node + 1)) \
    "$@" > "$FAKE_SLURM_LOG/task$node.log" 2>&1 &
  pids+=($!)
done
status=0
for _ in "${pids[@]}"; do
  wait -n
  rc=$?
  if ((rc != 0 && status == 0)); then
    status=$rc
    kill "${pids[@]}" 2> /dev/null
  fi
done
exit $status
"""

FAKE_SCONTROL = r"""#!/bin/bash
# Fake scontrol: the hosts of the allocation, one a line.
[[ $1 == show && $2 == hostnames && $3 == "$SLURM_JOB_NODELIST" ]] || { echo "fake scontrol: $*" >&2; exit 1; }
printf '127.0.0.1\n127.0.0.2\n'
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ran(codes: list[int], logs: list[Path]) -> None:
    tails = "\n".join(f"--- {log.name} (exit {code}) ---\n{log.read_text()[-4000:]}" for code, log in zip(codes, logs))
    assert codes == [0] * len(codes), tails


def finetune_cmd(*launcher: str) -> list[str]:
    return [sys.executable, *launcher, "-m", "moetune.cli", "finetune"]


def job_args(tmp_path: Path, out: Path) -> list[str]:
    return [*short_job_args(tmp_path, out), "--training.steps", str(STEPS), "--checkpoint.every", str(STEPS)]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The output folder of the same job as one node of two processes (``--nproc-per-node 2``)."""
    tmp = tmp_path_factory.mktemp("one_node")
    out = tmp / "out"
    log = tmp / "one_node.log"
    codes = run_concurrently([finetune_cmd() + ["--nproc-per-node", "2", *job_args(tmp, out)]], [log],
                             env=subprocess_env())
    check_ran(codes, [log])
    return out


def checkpoint_tensors(out: Path, tmp_path: Path) -> dict:
    """The step-STEPS checkpoint's state ("model", "optim"), read in one process."""
    path = tmp_path / f"{out.parent.name}_{out.name}.pt"
    dcp_to_torch_save(out / f"checkpoints/step_{STEPS:08d}/state", path)
    return torch.load(path, weights_only=True)


def check_like_one_node(out: Path, one_node: Path, logs: list[Path], tmp_path: Path) -> None:
    """``out`` holds what the one-node run wrote, written once, with the same losses and weights."""
    records = read_metrics(out)
    assert records[0]["processes"] == 2 and records[0]["nodes"] == 2
    assert read_metrics(one_node)[0]["nodes"] == 1
    got, expected = losses(records), losses(read_metrics(one_node))
    # One record per step (two writers would log each twice, or move the other's file away), and the
    # losses of one node, to the bit: the same global batches, the same gloo collectives.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert got == expected
    assert all(math.isfinite(v) for v in got.values()) and got[STEPS] < got[1]
    # Every file in the output folder (no markers left, no rotated metrics, no half checkpoint);
    # the checkpoint has each rank's shard and RNG state, train_state.json its world size.
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(one_node)) for p in one_node.rglob("*") if p.is_file())
    ckpt = f"checkpoints/step_{STEPS:08d}"
    assert {f"{ckpt}/rng_rank0.pt", f"{ckpt}/rng_rank1.pt", f"{ckpt}/state/__0_0.distcp",
            f"{ckpt}/state/__1_0.distcp", f"{ckpt}/train_state.json", "config.yaml", "metrics.jsonl",
            "final/model.safetensors", "final/config.json"} <= set(files)
    assert '"world_size": 2' in (out / ckpt / "train_state.json").read_text()
    # Rank 0 alone printed: one start message and one summary over both nodes' logs.
    text = "".join(log.read_text() for log in logs)
    assert text.count("processes: 2 on 2 nodes") == 1 and text.count("done: 3 steps") == 1, text[-4000:]
    # The export loads in plain Transformers, with the one-node run's weights; the checkpoint reads back.
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    exported = load_file(out / "final/model.safetensors")
    torch.testing.assert_close(exported, load_file(one_node / "final/model.safetensors"), rtol=1e-5, atol=1e-7)
    ours, theirs = checkpoint_tensors(out, tmp_path), checkpoint_tensors(one_node, tmp_path)
    for part in (lambda sd: sd["model"], lambda sd: sd["optim"]["state"]):
        torch.testing.assert_close(part(ours), part(theirs), rtol=1e-5, atol=1e-7)


def test_two_torchrun_nodes_of_one_process_train_as_one_node_of_two(tmp_path, one_node):
    out = tmp_path / "out"
    port = free_port()
    rdzv = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=moetune-test-{port}"]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    codes = run_concurrently([finetune_cmd(*rdzv) + job_args(tmp_path, out)] * 2, logs, env=subprocess_env())
    check_ran(codes, logs)
    check_like_one_node(out, one_node, logs, tmp_path)


def fake_slurm(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a batch script of a 2-node allocation: srun and scontrol shims first on
    PATH, Slurm's variables (none of this machine's own SLURM_*), the script's knobs in ``extra``."""
    shims = tmp_path / "shims"
    shims.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("SLURM")}
    job_id = str(free_port())
    return {**env, "PATH": f"{shims}{os.pathsep}{env['PATH']}", "FAKE_SLURM_LOG": str(tmp_path),
            "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
            "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1",
            "SLURM_SUBMIT_DIR": str(REPO), "GPUS_PER_NODE": "1", "MASTER_PORT": str(free_port()),
            "PYTHON": sys.executable, **extra}


def test_the_sbatch_example_trains_the_default_job_on_two_fake_nodes(tmp_path, one_node):
    """The script as sbatch runs it (the embedded default job: CONFIG empty; the shortening as extra
    arguments), one torchrun per fake node through srun."""
    out = tmp_path / "out"
    env = fake_slurm(tmp_path, CONFIG="", OUTPUT_DIR=str(out))
    log = tmp_path / "batch.log"
    codes = run_concurrently([["bash", str(SBATCH), *job_args(tmp_path, out)]], [log], env=env)
    logs = [log, tmp_path / "task0.log", tmp_path / "task1.log"]
    check_ran(codes, logs)
    srun_args = (tmp_path / "srun.args").read_text().split()
    assert srun_args[:5] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                             "--cpus-per-task=1"]
    assert f"--rdzv-endpoint=127.0.0.1:{env['MASTER_PORT']}" in srun_args and "--nproc-per-node=1" in srun_args
    assert "-c" not in srun_args  # CONFIG empty: the embedded default job
    check_like_one_node(out, one_node, logs, tmp_path)


def test_the_sbatch_example_fails_when_its_job_fails(tmp_path):
    """A job refused on both nodes (a bad override) fails the batch script with its status."""
    env = fake_slurm(tmp_path, CONFIG="examples/default.yaml", OUTPUT_DIR=str(tmp_path / "out"))
    log = tmp_path / "batch.log"
    codes = run_concurrently([["bash", str(SBATCH), "--training.steps", "0"]], [log], env=env)
    assert codes != [0]
    assert "-c examples/default.yaml --training.output_dir" in (tmp_path / "srun.args").read_text()
    assert "training.steps: must be >= 1" in (tmp_path / "task0.log").read_text()


def test_a_failed_node_gets_the_others_killed_whole(tmp_path):
    """run_concurrently's clean-up: when one command fails, one that hangs is killed after the grace
    period with what it started in a process session of its own (as torchrun starts its workers)."""
    pid_file = tmp_path / "worker.pid"
    hang = ["bash", "-c", f"setsid sleep 600 & echo $! > {pid_file}; wait"]
    logs = [tmp_path / "hang.log", tmp_path / "fail.log"]
    started = time.monotonic()
    codes = run_concurrently([hang, ["bash", "-c", "sleep 1; exit 3"]], logs, env=subprocess_env(), grace_s=0.5)
    assert codes == [-signal.SIGKILL, 3] and time.monotonic() - started < 30
    stat = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    for _ in range(50):  # SIGKILL takes effect asynchronously
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":  # gone, or a zombie
            return
        time.sleep(0.1)
    raise AssertionError(f"the worker {stat.parent.name} survived: {stat.read_text()}")
