"""Two gloo processes on the CPU through `moetune finetune --nproc-per-node 2` (torchrun):
FSDP2 with an exact resume from a sharded checkpoint, and DDP with a Transformers export."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from recipe_helpers import losses, read_metrics, run_concurrently, short_job_args, subprocess_env

pytestmark = pytest.mark.distributed


def run_job(tmp_path: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "moetune.cli", "finetune", "--nproc-per-node", "2", *short_job_args(tmp_path, out),
           *extra]
    log = tmp_path / f"{out.name}.log"
    # Its own process session, killed whole at the timeout: torchrun's workers must not outlive a hung test.
    (code,) = run_concurrently([cmd], [log], env=subprocess_env(), timeout_s=240)
    assert code == 0, log.read_text()[-9000:]
    return read_metrics(out)


def test_fsdp2_two_ranks_resume_exactly(tmp_path):
    """The checkpoint of step 2 is written right after a validation pass (forwards without gradients,
    after which FSDP2 would keep the root group gathered if moetune did not reshard it)."""
    val = ("--training.val_every", "2")
    records = run_job(tmp_path, tmp_path / "full", "--training.steps", "4", "--checkpoint.every", "2",
                      "--checkpoint.export_final", "false", *val)
    # FSDP2 without expert parallelism of an architecture moetune implements: sharded on the meta
    # device by moetune, each rank reading its own weights.
    assert records[0]["sharding"].startswith("sharded by moetune over 2 processes (expert parallelism 1, the rest FSDP2)")
    full = losses(records)
    resumed = losses(run_job(tmp_path, tmp_path / "resumed", "--training.steps", "4", "--checkpoint.resume",
                             str(tmp_path / "full/checkpoints/step_00000002"), "--checkpoint.export_final", "false", *val))
    assert sorted(resumed) == [3, 4]
    assert [resumed[3], resumed[4]] == [full[3], full[4]]


def test_ddp_two_ranks_train_and_export(tmp_path):
    records = run_job(tmp_path, tmp_path / "ddp", "--training.steps", "2", "--distributed.parallelism", "ddp")
    assert records[0]["sharding"] == "DDP"
    assert sorted(losses(records)) == [1, 2]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ddp/final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_ddp_gradient_accumulation_matches_bigger_micro_batches(tmp_path):
    """Two micro-batches of one row per step, the first under DDP's no_sync (the gradients are reduced
    once, in the last backward), train as one micro-batch of two rows: the same global batch, the
    same losses. (Reducing in the wrong backward leaves the ranks apart and fails this.) Without the
    load-balancing loss: it is not linear in the batch (its expert fractions are per micro-batch, as
    in Transformers), so with it the two differ by design (~1e-5 of the gradient norm here)."""
    no_aux = ("--model.router_aux_loss_coef", "0")
    accumulated = losses(run_job(tmp_path, tmp_path / "acc", "--training.steps", "3", "--distributed.parallelism", "ddp",
                                 "--training.grad_accum_steps", "2", "--checkpoint.export_final", "false", *no_aux))
    single = losses(run_job(tmp_path, tmp_path / "one", "--training.steps", "3", "--distributed.parallelism", "ddp",
                            "--training.micro_batch_size", "2", "--checkpoint.export_final", "false", *no_aux))
    assert sorted(accumulated) == [1, 2, 3]
    for step in (1, 2, 3):
        assert accumulated[step] == pytest.approx(single[step], rel=1e-5), f"step {step}"


def test_expert_parallel_two_ranks_train_resume_and_export(tmp_path):
    ep = ("--distributed.ep_size", "2")
    full = losses(run_job(tmp_path, tmp_path / "ep", "--training.steps", "4", "--checkpoint.every", "2", *ep))
    resumed = losses(run_job(tmp_path, tmp_path / "ep-resumed", "--training.steps", "4", "--checkpoint.resume",
                             str(tmp_path / "ep/checkpoints/step_00000002"), "--checkpoint.export_final", "false", *ep))
    assert [resumed[3], resumed[4]] == [full[3], full[4]]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ep/final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("ep_size", [1, 2])
def test_lora_sharded_by_moetune_exports_a_peft_adapter_and_the_merged_model(tmp_path, ep_size):
    """The PEFT adapter, and the merged model (adapters folded into the gathered shards), which
    equals PEFT's own merge of that adapter into the base: FSDP2 alone (ep_size 1) and with expert
    parallelism (the pipelined dispatcher, distributed.ep_overlap_chunks)."""
    import peft

    sharding = ("--distributed.ep_size", "2", "--distributed.ep_overlap_chunks", "2") if ep_size == 2 else ()
    run_job(tmp_path, tmp_path / "lora", "--training.steps", "2", *sharding,
            "--lora.enabled", "true", "--lora.target_experts", "true", "--lora.export_merged", "true")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora/base")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "lora/adapter")
    assert any("experts" in name for name, _ in model.named_parameters() if "lora" in name)
    peft_merged = model.merge_and_unload().state_dict()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora/final").state_dict()
    assert exported.keys() == peft_merged.keys()
    for name, value in peft_merged.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_allgather_dispatch_with_replicated_dense_parameters(tmp_path):
    """distributed.ep_dispatch allgather + dense_parallel replicate + vocab_parallel: trains (moetune's
    AdamW steps the replicated tensors and the expert and vocabulary DTensors together), evaluates by
    generation (the split LM head's logits) and exports a plain Transformers checkpoint."""
    records = run_job(tmp_path, tmp_path / "ag", "--training.steps", "2", "--distributed.ep_size", "2",
                      "--distributed.ep_dispatch", "allgather", "--distributed.dense_parallel", "replicate",
                      "--distributed.vocab_parallel", "true")
    assert sorted(losses(records)) == [1, 2]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ag/final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
