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
