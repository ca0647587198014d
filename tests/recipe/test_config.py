"""Config schema, YAML + dotted overrides, error messages, every shipped YAML, the CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from moetune.cli import main
from moetune.recipe.config import JobConfig
from moetune.recipe.config_loading import all_keys, field_docs, load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def sections(cls=JobConfig):
    yield cls
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from sections(hint)


@pytest.mark.parametrize("cls", list(sections()), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == []


def test_defaults_are_the_embedded_default_job():
    config = load_config()
    assert Path(config.model.config_path, "config.json").is_file()
    assert Path(config.data.train_path).is_file() and Path(config.data.test_path).is_file()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    config = load_config(yaml_path=path)
    assert config.training.steps >= 1


def test_examples_cover_the_required_jobs():
    names = {p.name for p in EXAMPLES}
    assert {"default.yaml", "qwen3_30b_a3b_sft.yaml", "qwen3_30b_a3b_lora.yaml"} <= names
    assert load_config(yaml_path=REPO / "examples/qwen3_30b_a3b_lora.yaml").lora.enabled


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  lr: 1e-4\n  warmup_steps: 7\ntraining:\n  steps: 11\n")
    config = load_config(yaml_path=path, overrides=["--optim.lr", "1e-5", "training.micro_batch_size=3"])
    assert (config.optim.lr, config.optim.warmup_steps, config.training.steps) == (1e-5, 7, 11)
    assert config.training.micro_batch_size == 3 and config.optim.eps == JobConfig().optim.eps


def test_lists_tuples_bools_and_none_are_parsed():
    config = load_config(overrides=["--optim.betas", "0.8,0.9", "--lora.target_modules", "[q_proj, o_proj]",
                                    "--data.packing", "false", "--model.router_aux_loss_coef", "null"])
    assert config.optim.betas == (0.8, 0.9) and config.lora.target_modules == ["q_proj", "o_proj"]
    assert config.data.packing is False and config.model.router_aux_loss_coef is None


def test_null_is_the_empty_text_or_none_from_yaml_and_the_command_line(tmp_path):
    """Never the string "None": `data.test_path:` (nothing after it) means no held-out set, as "" does."""
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  test_path:\ncheckpoint:\n  resume: null\nmetrics:\n  wandb_project: ~\n"
                    "model:\n  router_aux_loss_coef: null\n")
    config = load_config(yaml_path=path)
    assert (config.data.test_path, config.checkpoint.resume, config.metrics.wandb_project) == ("", "", "")
    assert config.model.router_aux_loss_coef is None
    config = load_config(overrides=["--data.test_path", "null", "--checkpoint.resume", "None",
                                    "--model.router_aux_loss_coef", "~"])
    assert (config.data.test_path, config.checkpoint.resume, config.model.router_aux_loss_coef) == ("", "", None)
    path.write_text("training:\n  steps:\n")
    with pytest.raises(ValueError, match=r"config field training.steps: expected an integer, got None \(from .*job.yaml\)"):
        load_config(yaml_path=path)


def test_unknown_key_names_it_and_the_closest_valid_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key 'optim.lrr' \(from command line\); did you mean 'optim.lr'"):
        load_config(overrides=["--optim.lrr", "1"])
    path = tmp_path / "typo.yaml"
    path.write_text("training:\n  stpes: 3\n")
    with pytest.raises(ValueError, match=r"'training.stpes' \(from .*typo.yaml\); did you mean 'training.steps'"):
        load_config(yaml_path=path)


@pytest.mark.parametrize("override, message", [
    (["--optim.lr", "fast"], "config field optim.lr: expected a number, got 'fast'"),
    (["--training.steps", "2.5"], "config field training.steps: expected an integer"),
    (["--training.steps", "0"], "config field training.steps: must be >= 1, got 0"),
    (["--training.precision", "fp8"], "config field training.precision: 'fp8' is not one of"),
    (["--data.on_bad_row", "ignore"], "config field data.on_bad_row"),
    (["--data.packing_strategy", "first_fit"], "config field data.packing_strategy: 'first_fit' is not one of"),
    (["--data.pad_to_multiple_of", "-8"], "config field data.pad_to_multiple_of: must be >= 0"),
    (["--lora.rank", "-1"], "config section lora: LoraSettings.rank must be a positive int"),
    (["--data.max_new_tokens", "0"], "config field data.max_new_tokens: must be >= 1, got 0"),
    (["--model.experts_backend", "cublas"], "config field model.experts_backend: experts_backend must be one of .*, got 'cublas'"),
    (["--distributed.ep_overlap_chunks", "0"], "config field distributed.ep_overlap_chunks: must be >= 1, got 0"),
    (["--distributed.replicate_max_ctas", "-1"], "config field distributed.replicate_max_ctas: must be >= 0, got -1"),
    (["--distributed.ep_dispatch", "broadcast"], "config field distributed.ep_dispatch: 'broadcast' is not one of"),
    (["--distributed.dense_parallel", "ddp"], "config field distributed.dense_parallel: 'ddp' is not one of"),
    (["--distributed.replicate_transport", "nvlink"], "config field distributed.replicate_transport: 'nvlink' is not one of"),
    (["--distributed.vocab_parallel", "true"], "config field distributed.vocab_parallel: splits the embedding and LM head"),
    (["--distributed.ep_dispatch", "allgather", "--distributed.ep_overlap_chunks", "2"],
     "config field distributed.ep_overlap_chunks: chunked overlap refines the all-to-all dispatcher"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(overrides=override)


def test_missing_yaml_file_is_named():
    with pytest.raises(ValueError, match="config file nope.yaml does not exist"):
        load_config(yaml_path="nope.yaml")


def test_every_key_is_reachable_from_the_cli():
    assert "optim.lr" in all_keys() and "lora.target_experts" in all_keys() and "lora.enabled" in all_keys()


def test_the_usage_text_points_to_the_option_that_lists_every_field(capsys):
    assert main([]) == 2
    usage = capsys.readouterr().err
    listed = [line.split("#")[0].split()[-1] for line in usage.splitlines() if "every config field" in line]
    assert listed == ["--help-config"]
    assert main(["finetune", listed[0]]) == 0 and "--training.output_dir (default" in capsys.readouterr().out


def test_cli_help_lists_fields_and_errors_exit_with_the_message(capsys):
    assert main(["finetune", "--help-config"]) == 0
    assert f"--optim.lr (default {JobConfig().optim.lr})" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["finetune", "--optim.lrr", "1"])
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


def test_nproc_per_node_reexecs_through_torchrun(tmp_path):
    # os.execv replaced by a print + exit: the command line is checked, no job starts.
    out = subprocess.run([sys.executable, "-c", "import os, sys; os.execv = lambda exe, cmd: sys.exit(print(cmd)); "
                          "from moetune.cli import main; main(['finetune', '--nproc-per-node', '2', '--optim.lr', '1e-5'])"],
                         capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert "'-m', 'torch.distributed.run'" in out and "'--nproc-per-node=2'" in out
    assert out.strip().endswith("'-m', 'moetune.cli', 'finetune', '--optim.lr', '1e-5']")


def test_nproc_per_node_is_refused_in_each_of_several_srun_tasks(monkeypatch, capsys):
    """srun on several nodes would start one single-node job per task, all writing one output folder."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--nproc-per-node", "8"])
    assert exit_info.value.code == 2
    assert "srun started this command 2 times: launch torchrun yourself" in capsys.readouterr().err


def test_cli_reports_a_missing_data_file_without_a_traceback(capsys):
    assert main(["finetune", "--data.train_path", "missing/train.jsonl"]) == 2
    assert "error: data.train_path: file missing/train.jsonl does not exist" in capsys.readouterr().err


def test_the_saved_config_of_a_run_loads_back_identically(tmp_path):
    from moetune.recipe.config_loading import save_config

    config = load_config(overrides=["--optim.betas", "0.8,0.9", "--lora.enabled", "true"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(yaml_path=tmp_path / "config.yaml") == config


def test_distributed_fields_reach_moetune_options():
    """The recipe's distributed section becomes ``from_pretrained``'s moetune options, and every key is
    a ``MoetuneOptions`` field (0 CTAs = NCCL's own choice, passed as None)."""
    import dataclasses

    import torch

    from moetune.options import MoetuneOptions
    from moetune.recipe.distributed_setup import Runtime, sharding_options

    runtime = Runtime(device=torch.device("cpu"), rank=0, world_size=2)
    config = load_config(overrides=["--distributed.ep_size", "2", "--distributed.dense_parallel", "replicate",
                                    "--distributed.vocab_parallel", "true"]).distributed  # fmt: skip
    options = sharding_options(runtime, config, lora=None)
    assert options["replicate_max_ctas"] == 16 and options["dense_parallel"] == "replicate" and options["vocab_parallel"]
    assert options["replicate_transport"] == "nccl"
    assert set(options) <= {field.name for field in dataclasses.fields(MoetuneOptions)}
    MoetuneOptions(**options)  # valid as a whole
    uncapped = load_config(overrides=["--distributed.ep_size", "2", "--distributed.replicate_max_ctas", "0"]).distributed
    assert sharding_options(runtime, uncapped, lora=None)["replicate_max_ctas"] is None
    assert sharding_options(Runtime(device=torch.device("cpu")), config, lora=None) is None  # one process: no EP


def test_quack_experts_without_the_package_are_refused_before_any_work(monkeypatch):
    import sys

    from moetune.kernels import quack_grouped_gemm

    quack_grouped_gemm.require.cache_clear()
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    try:
        with pytest.raises(ValueError, match="config field model.experts_backend: experts_backend='quack' needs the quack-kernels package"):
            load_config(overrides=["--model.experts_backend", "quack"])
    finally:
        quack_grouped_gemm.require.cache_clear()


def test_experts_backend_reaches_the_model():
    import torch

    from moetune.moe import GroupedExperts
    from moetune.recipe.model_loading import build_model, load_model_config

    config = load_config(overrides=["--model.experts_backend", "loop"]).model
    model = build_model(config, model_config=load_model_config(config), dtype=torch.float32, device=torch.device("cpu"))
    backends = {m.backend for m in model.modules() if isinstance(m, GroupedExperts)}
    assert backends == {"loop"}
