"""TRL's SFTTrainer trains a moetune model unchanged (one device, unsharded), from chat messages
formatted by the shipped tokenizer's chat template."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import moetune
from moetune.recipe.config import DEFAULT_ASSETS

trl = pytest.importorskip("trl", reason="TRL is a test extra")
datasets = pytest.importorskip("datasets", reason="datasets is a test extra")


def test_sft_trainer_trains_a_moetune_model(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_ASSETS / "tokenizer")
    model_config = AutoConfig.from_pretrained(DEFAULT_ASSETS / "model")
    torch.manual_seed(0)
    model = moetune.AutoModelForCausalLM.from_config(model_config)
    assert type(model).__module__.startswith("moetune.")
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(8) for b in range(8)
    ]  # fmt: skip
    before = model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    trainer = trl.SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        args=trl.SFTConfig(
            output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8, learning_rate=3e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
            dataloader_num_workers=0,
        ),
    )
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert result.global_step == 6
    assert not torch.equal(model.model.layers[1].mlp.experts.gate_up_proj.detach(), before)
