"""The default job end to end (small settings), its Hugging Face export, metrics and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from moetune.recipe.config import DEFAULT_ASSETS
from moetune.recipe.train import finetune

REPO = Path(__file__).resolve().parents[2]


def test_shipped_assets_are_a_real_tokenizer_config_and_dataset():
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_ASSETS / "tokenizer")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_ids_to_tokens(tokenizer("123")["input_ids"]) == ["1", "2", "3"]
    config = transformers.AutoConfig.from_pretrained(DEFAULT_ASSETS / "model")
    assert config.model_type == "qwen3_moe" and config.mlp_only_layers == [0] and config.num_experts == 8
    train = {line for line in (DEFAULT_ASSETS / "data/train.jsonl").read_text().splitlines()}
    test = (DEFAULT_ASSETS / "data/test.jsonl").read_text().splitlines()
    assert not train & set(test)  # held out for real


def test_default_job_end_to_end_small(tiny_job, tmp_path):
    out = tmp_path / "job"
    result = finetune(tiny_job(out, training__steps=6, training__val_every=3, checkpoint__export_final=True,
                               metrics__plots=True))
    assert len(result.losses) == 6 and all(loss == loss for loss in result.losses)  # no NaN
    assert result.accuracy_before is not None and result.accuracy_after is not None
    assert result.val_loss is not None
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in step_records] == [1, 2, 3, 4, 5, 6]
    for key in ("lr", "grad_norm", "tokens_per_s_per_gpu", "tflops_per_gpu", "peak_mem_gib"):
        assert all(r[key] is not None for r in step_records), key
    assert all(r["mfu"] is None for r in step_records)  # CPU: n/a
    # Real tokens over token positions (~22-token samples in 64-token rows: 2-3 fit, the rest pads).
    assert all(0.6 < r["row_fill"] <= 1.0 for r in step_records), [r["row_fill"] for r in step_records]
    assert [r["step"] for r in records if "val_loss" in r and "loss" in r] == [3, 6]
    final = [r for r in records if r.get("final")][-1]
    assert len(final["expert_tokens"]) == 2 and len(final["expert_tokens"][0]) == 8  # 2 MoE layers x 8 experts
    assert sum(final["expert_tokens"][0]) > 0
    assert (out / "plots/loss.png").stat().st_size > 0 and (out / "plots/expert_load.png").stat().st_size > 0

    # Plain Transformers loads the export and generates from it.
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_the_real_default_job_learns_in_five_minutes(tmp_path):
    """The README's first command, as is: >= 80% held-out exact match within 5 minutes."""
    start = time.time()
    run = subprocess.run([sys.executable, "-m", "moetune.cli", "finetune", "--training.output_dir", str(tmp_path),
                          "--metrics.progress_bar", "false"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    elapsed = time.time() - start
    final = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["accuracy_before"] < 0.05 and final["accuracy_after"] >= 0.8, run.stdout[-2000:]
    assert elapsed < 300


def test_fine_tuning_a_pretrained_checkpoint_starts_from_its_weights(tiny_job, tmp_path):
    first = finetune(tiny_job(tmp_path / "first", training__steps=8, optim__lr=3e-3,
                              checkpoint__export_final=True))
    again = finetune(tiny_job(tmp_path / "second", training__steps=1, optim__lr=1e-9,
                              model__pretrained_path=tmp_path / "first/final", model__tokenizer_path=""))
    assert again.losses[0] < first.losses[0] - 0.5  # not a fresh random model
