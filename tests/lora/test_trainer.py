"""Transformers' Trainer trains a moetune model unchanged (CPU, one device, unsharded), with and
without LoRA."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import transformers

from moetune.lora import LoraSettings, apply_lora, lora_state_dict

from .helpers import build_moetune_model, tiny_qwen3_moe_config

pytest.importorskip("accelerate")  # Trainer needs it

_NUM_STEPS = 12


# Transformers renamed TrainingArguments' gradient_checkpointing (5.10) to activation_checkpointing.
_CHECKPOINTING_ARGUMENT = next(
    name for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in inspect.signature(transformers.TrainingArguments.__init__).parameters
)


def _dataset() -> list[dict[str, torch.Tensor]]:
    # Four fixed sequences seen again and again: the loss must fall quickly if training works.
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 128, (4, 16), generator=generator)
    return [{"input_ids": row, "labels": row.clone(), "attention_mask": torch.ones_like(row)} for row in rows]


def _train(
    model, tmp_path, *, learning_rate: float, activation_checkpointing: bool = False, trainer_cls=transformers.Trainer
) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=_NUM_STEPS,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **{_CHECKPOINTING_ARGUMENT: activation_checkpointing},
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_learns(losses: list[float]) -> None:
    assert len(losses) == _NUM_STEPS
    assert all(math.isfinite(loss) for loss in losses)
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    # 0.1 nats: LoRA cannot go far here, the frozen random lm_head bounds the logits' range.
    assert last < first - 0.1, losses


def test_trainer_full_finetune(tmp_path):
    model = build_moetune_model(tiny_qwen3_moe_config()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_learns(_train(model, tmp_path, learning_rate=3e-3))
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(model.state_dict()[experts], before[experts])


def test_trainer_lora_with_activation_checkpointing(tmp_path):
    # Checkpointing recomputes each layer in backward: the expert deltas must be rebuilt there too.
    model = build_moetune_model(tiny_qwen3_moe_config()).train()
    apply_lora(model, LoraSettings(rank=4, alpha=8))
    base_before = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    _assert_learns(_train(model, tmp_path, learning_rate=1e-2, activation_checkpointing=True))
    assert getattr(model, f"is_{_CHECKPOINTING_ARGUMENT}")  # the Trainer switched it on
    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            assert torch.equal(value, base_before[key]), key
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(model).items() if "lora_B_" in k)


def test_moetune_trainer_is_transformers_trainer_for_unsharded_models(tmp_path):
    """``moetune.Trainer`` (for expert-parallel models, tests/distributed) changes nothing otherwise."""
    import moetune

    losses = {}
    for name, cls in (("transformers", transformers.Trainer), ("moetune", moetune.Trainer)):
        torch.manual_seed(0)
        model = build_moetune_model(tiny_qwen3_moe_config()).train()
        losses[name] = _train(model, tmp_path / name, learning_rate=3e-3, trainer_cls=cls)
    assert losses["moetune"] == losses["transformers"]


@pytest.mark.parametrize("pin_memory", [True, False])
def test_moetune_trainer_copies_pinned_batches_without_blocking_on_one_gpu(tmp_path, monkeypatch, pin_memory):
    """On one GPU (pretended here) the host must not wait for each step's optimizer before copying the
    next batch; Transformers' Trainer keeps accelerate's blocking copy, and so does moetune's without
    pinned memory (a non-blocking copy from pageable memory is not asynchronous)."""
    import moetune
    from moetune.integrations import trainer as integration

    monkeypatch.setattr(integration, "_trainable_on_one_cuda_device", lambda model: True)
    model = build_moetune_model(tiny_qwen3_moe_config())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.dataloader_pin_memory = pin_memory  # use_cpu turns it off; on a GPU it is on by default
    ours = moetune.Trainer(model=model, args=args, train_dataset=_dataset())
    theirs = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    assert ours.accelerator.dataloader_config.non_blocking is pin_memory
    assert theirs.accelerator.dataloader_config.non_blocking is False
    assert args.accelerator_config.non_blocking is False  # the user's arguments are left as they were


def test_trainer_resumes_a_full_finetune_exactly(tmp_path):
    """``resume_from_checkpoint`` reads the checkpoint's model.safetensors (experts in the Hub's
    per-expert layout, as ``save_pretrained`` writes them) through ``model.load_state_dict``: the
    experts must come back, so a resumed run ends where an uninterrupted one does."""
    final = {}
    for name, resume in (("straight", None), ("resumed", "checkpoint-2")):
        model = build_moetune_model(tiny_qwen3_moe_config()).train()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=4, learning_rate=3e-3,
            lr_scheduler_type="linear", save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        if resume:  # a model with other experts resumes from the straight run's middle checkpoint
            with torch.no_grad():
                model.model.layers[0].mlp.experts.gate_up_proj.normal_()
            resume = str(tmp_path / "straight" / resume)
        transformers.Trainer(model=model, args=args, train_dataset=_dataset()).train(resume_from_checkpoint=resume)
        final[name] = model.state_dict()
    for key, value in final["straight"].items():
        torch.testing.assert_close(final["resumed"][key], value, rtol=0, atol=0, msg=key)


def test_load_state_dict_takes_the_per_expert_layout_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file

    source = build_moetune_model(tiny_qwen3_moe_config())
    source.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved
    torch.manual_seed(5)
    target = build_moetune_model(tiny_qwen3_moe_config(initializer_range=0.5))
    target.load_state_dict(saved)  # strict
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    del saved["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key.*experts\.gate_up_proj"):
        target.load_state_dict(saved)


def test_moetune_trainer_names_an_optimizer_that_cannot_step_expert_parallel_shards(tmp_path):
    """Transformers' Adafactor updates plain tensors; on an expert-parallel model (DTensor shards) it
    failed in the first step with "mixed torch.Tensor and DTensor". moetune.Trainer names the option."""
    from moetune import Trainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim="adafactor", use_cpu=True, report_to=[])
    trainer = Trainer(model=build_moetune_model(tiny_qwen3_moe_config()), args=args, train_dataset=_dataset())
    trainer._moetune_parallel = True  # what an ep_size model under torchrun sets (tests/distributed run those)
    with pytest.raises(ValueError, match=r"TrainingArguments.optim='adafactor'.*ep_size.*adamw_torch"):
        trainer.create_optimizer()
