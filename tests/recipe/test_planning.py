"""``moetune finetune`` plans the job before it starts: ``--dry-run`` prints the plan and exits; a job
that cannot fit its GPUs is refused before any data or weight is read; on CPU the plan is printed
and the job runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.cli import main
from moetune.recipe import train
from moetune.recipe.model_loading import load_model_config
from moetune.recipe.planning import JobShape, check_job_fits, plan_job

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def qwen3(tmp_path) -> str:
    """A folder holding Qwen3-30B-A3B's config.json (model.config_path takes a folder or a config.json)."""
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    (folder / "config.json").write_text((REPO / "moetune/assets/configs/qwen3_30b_a3b.json").read_text())
    return str(folder)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["finetune", "--dry-run", "--training.output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "moetune plan:" in printed and "Memory per GPU" in printed and "no GPU calibration" in printed
    assert not out.exists()


def test_dry_run_plans_the_job_for_the_named_gpus(capsys, qwen3):
    args = ["finetune", "--dry-run", "--nproc-per-node", "8", "--plan-gpu", "h100", "--model.config_path", qwen3,
            "--data.max_length", "4096", "--training.micro_batch_size", "1", "--distributed.ep_size", "8",
            "--training.precision", "bf16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "on 1 x 8 NVIDIA H100 80GB HBM3" in printed and "Settings (fits): ep_size 8" in printed
    assert "tokens/s/GPU" in printed
    # The same job on one GPU does not fit: exit status 1, with what would.
    args[args.index("--nproc-per-node") + 1] = "1"
    args[args.index("--distributed.ep_size") + 1] = "1"
    assert main(args) == 1
    assert "What would" in capsys.readouterr().out


def test_the_job_s_own_settings_are_planned(tiny_job, qwen3):
    config = tiny_job(**{"model.config_path": qwen3, "data.max_length": 4096, "training.micro_batch_size": 1,
                         "training.grad_accum_steps": 4, "distributed.ep_size": 8,
                         "model.activation_checkpointing": True, "model.activation_checkpointing_mode": "selective",
                         "lora.enabled": True})
    shape = JobShape(world=16, gpus_per_node=8, gpu="h200", gpu_memory_gib=None, cuda_graph=False)
    plan = plan_job(config, load_model_config(config.model), shape)
    s = plan.best.setting
    assert (s.ep, s.recompute, s.micro_batch, s.grad_accum, s.dense_parallel) == (8, "selective", 1, 4, "fsdp")
    assert plan.request.world == 16 and plan.request.precision == "fp32_master"  # training.precision auto on GPU
    assert plan.inventory.lora_rank == config.lora.rank
    assert len(plan.candidates) == 1


def test_a_job_that_cannot_fit_is_refused_before_data_or_weights_are_read(tiny_job, monkeypatch, capsys):
    """A GPU too small for the tiny model: the plan is printed, then a ValueError with its numbers,
    before prepare_data or the model is built."""
    read = []
    monkeypatch.setattr(train, "prepare_data", lambda *a, **k: read.append("data") or pytest.fail("data was read"))
    monkeypatch.setattr(train, "build_model", lambda *a, **k: read.append("model") or pytest.fail("model was built"))
    small = JobShape(world=1, gpus_per_node=1, gpu="h100", gpu_memory_gib=0.001, cuda_graph=False)
    monkeypatch.setattr(train, "job_shape", lambda runtime, cuda_graph: small)
    with pytest.raises(ValueError, match=r"the job needs [\d.]+ GiB per GPU \(peak [\d.]+ GiB: parameters .* and the GPU "
                                         r"has 0\.0 GiB\. What would fit"):
        train.finetune(tiny_job())
    assert read == [] and "moetune plan:" in capsys.readouterr().out


def test_plan_check_false_prints_but_does_not_refuse(tiny_job, capsys):
    config = tiny_job(**{"training.plan_check": False})
    small = JobShape(world=1, gpus_per_node=1, gpu="h100", gpu_memory_gib=0.001, cuda_graph=False)
    check_job_fits(config, load_model_config(config.model), small, announce=print)
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_on_cpu_the_plan_is_printed_and_nothing_is_refused(tiny_job, capsys):
    config = tiny_job()
    cpu = JobShape(world=1, gpus_per_node=1, gpu="cpu", gpu_memory_gib=None, cuda_graph=False)
    check_job_fits(config, load_model_config(config.model), cpu, announce=print)
    printed = capsys.readouterr().out
    assert "moetune plan:" in printed and "memory only" in printed and "no GPU memory to fit" in printed
