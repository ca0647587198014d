"""LoRA through the recipe's config: only adapters train; the PEFT export loads in `peft`."""

from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file

from moetune.recipe.train import finetune


def test_lora_job_trains_adapters_only_and_exports_peft_and_merged(tiny_job, tmp_path):
    out = tmp_path / "lora"
    result = finetune(tiny_job(out, training__steps=3, lora__enabled="true", lora__rank=4, optim__lr=1e-2,
                               checkpoint__export_final=True))
    assert result.losses[-1] < result.losses[0]
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(out / "base")
    expert_a = [k for k in adapter if "mlp.experts" in k and "lora_A" in k]
    assert expert_a and all(adapter[k].shape[0] == 8 * 4 for k in expert_a)  # one rank-4 adapter per expert
    assert all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)  # every adapter trained

    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.tensor([[1, 200, 30, 31, 12, 2, 201, 1, 210]])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_model = peft.PeftModel.from_pretrained(base, out / "adapter")
        peft_logits = peft_model(ids).logits
        merged_logits = merged(ids).logits
    # merged = trained model; equal to base + adapters only if the base weights never moved.
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-4, atol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-3


def test_lora_steps_change_adapter_parameters_only(tiny_job, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "lora"
    finetune(tiny_job(out, training__steps=2, lora__enabled="true", lora__rank=2, optim__lr=1e-2,
                      checkpoint__every=2, optim__weight_decay=0.1))
    dcp_to_torch_save(out / "checkpoints/step_00000002/state", tmp_path / "state.pt")
    trained = torch.load(tmp_path / "state.pt", weights_only=False)["model"]
    # Loaded through Transformers: the file stores experts per expert (the Hub layout).
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base").state_dict()
    adapters = [k for k in trained if k.rpartition(".")[2].startswith("lora_")]
    assert any("experts.lora_" in k for k in adapters) and any("q_proj.lora_" in k for k in adapters)
    for name, tensor in base.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=0, msg=name)  # frozen, even with decay


def test_the_adapter_names_its_base_by_an_absolute_path(tiny_job, tmp_path, monkeypatch):
    """A relative training.output_dir: the adapter still loads from another directory."""
    import os

    import peft

    monkeypatch.chdir(tmp_path)
    finetune(tiny_job("relative_out", training__steps=1, lora__enabled="true", lora__rank=2,
                      checkpoint__export_final=True, lora__export_merged="false"))
    config = json.loads((tmp_path / "relative_out/adapter/adapter_config.json").read_text())
    assert os.path.isabs(config["base_model_name_or_path"])
    assert config["base_model_name_or_path"] == str((tmp_path / "relative_out/base").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "relative_out/adapter")  # reads the base path
    assert any("lora_A" in name for name, _ in model.named_parameters())
