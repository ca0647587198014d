"""Export moetune adapters as a PEFT LoRA adapter for the plain Transformers v5 model.

Writes `adapter_config.json` + `adapter_model.safetensors` exactly as `peft` 0.17+ writes them,
so `PeftModel.from_pretrained(transformers_model, out_dir)` loads them. The mapping
(E experts, R rank, O/I out/in features of the expert weight):

- Linear `X`:        `base_model.model.X.lora_A.weight` = A [R, I], `...lora_B.weight` = B [O, R]
                     (`target_modules`).
- Expert weight `P` of module `M` (`target_parameters`, PEFT's ParamWrapper): PEFT stores one
  nn.Linear pair per weight, lora_A.weight [E*R, I] with row e*R + r, and lora_B.weight [O, R*E]
  with column r*E + e (see ParamWrapper.get_delta_weight: A.reshape(E, R, I),
  B.reshape(O, R, E)). PEFT nests one wrapper per targeted weight in the module's parameter
  order, the first innermost, so the key of the k-th of n weights is
  `M.` + `base_layer.` * (n - 1 - k) + `lora_A.weight`: for Qwen3-MoE
  `mlp.experts.base_layer.lora_A.weight` is gate_up_proj's and `mlp.experts.lora_A.weight` is
  down_proj's.
Scaling is lora_alpha / r in both (no rsLoRA).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from moetune.lora.apply import SETTINGS_ATTR
from moetune.lora.experts import adapted_params, is_lora_experts, lora_a_name, lora_b_name
from moetune.lora.linear import LORA_A, LORA_B, is_lora_linear
from moetune.lora.settings import LoraSettings

_PREFIX = "base_model.model."


def peft_adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's serialized names and layouts (contiguous, on CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{_PREFIX}{name}." if name else _PREFIX
        if is_lora_linear(module):
            tensors[prefix + "lora_A.weight"] = _full(getattr(module, LORA_A).detach())
            tensors[prefix + "lora_B.weight"] = _full(getattr(module, LORA_B).detach())
        elif is_lora_experts(module):
            params = adapted_params(module)
            for index, pname in enumerate(params):
                key = prefix + "base_layer." * (len(params) - 1 - index)
                lora_A_ERI = _full(module._parameters[lora_a_name(pname)].detach())
                lora_B_EOR = _full(module._parameters[lora_b_name(pname)].detach())
                num_experts, rank, in_features = lora_A_ERI.shape
                tensors[key + "lora_A.weight"] = lora_A_ERI.reshape(num_experts * rank, in_features)
                # [E, O, R] -> [O, R, E] -> [O, R*E]: PEFT's column r*E + e.
                tensors[key + "lora_B.weight"] = lora_B_EOR.permute(1, 2, 0).reshape(lora_B_EOR.shape[1], -1)
    return {key: t.to("cpu").contiguous() for key, t in tensors.items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # Expert-parallel adapters are DTensors: gather every expert (a collective: call on all ranks).
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _target_parameters(model: nn.Module) -> list[str]:
    # `experts.gate_up_proj`: PEFT matches target_parameters as dotted suffixes of parameter names.
    targets = []
    for name, module in model.named_modules():
        if is_lora_experts(module):
            leaf = name.rpartition(".")[2]
            targets += [f"{leaf}.{pname}" for pname in adapted_params(module) if f"{leaf}.{pname}" not in targets]
    return targets


def _peft_lora_config(model: nn.Module, settings: LoraSettings, base_model_name_or_path: str | None):
    try:
        from peft import LoraConfig
    except ImportError as err:  # peft is an optional dependency (extras "recipe" / "test")
        raise ImportError("export_peft_adapter needs the `peft` package: pip install peft") from err
    target_parameters = _target_parameters(model)
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        # PEFT's expert wrapper refuses dropout != 0; dropout does nothing at inference anyway.
        lora_dropout=0.0 if target_parameters else settings.dropout,
        target_modules=list(settings.target_modules),
        target_parameters=target_parameters or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
        inference_mode=True,
    )


def _check_peft_keeps_targets(model: nn.Module, config) -> None:
    """PEFT on Transformers v5 rewrites v4 expert names in target_modules (`gate_proj`, `up_proj`,
    `down_proj`, `w1`..`w3`, `gate`) into expert target_parameters for MoE model types whose
    checkpoints it converts (Qwen3-MoE, DeepSeek-V3, Mixtral, ...). An adapter on a dense MLP or a
    shared expert with such a name would then load onto the wrong weight: refuse to export it."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # older peft (Transformers v4 era) does not rewrite
        return
    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    rewritten = set(config.target_modules) - set(probe.target_modules)
    if rewritten:
        raise ValueError(
            f"LoraSettings.target_modules {sorted(rewritten)}: peft re-targets these names to the grouped "
            f"experts of a {model.config.model_type} model when loading, so a PEFT adapter cannot carry them; "
            "merge them (merge_lora) or adapt only attention modules"
        )


def export_peft_adapter(model: nn.Module, out_dir: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters of `model` (after `apply_lora`) as a PEFT adapter directory; returns it.

    `base_model_name_or_path` is recorded in adapter_config.json (PEFT's field of that name) so
    `AutoPeftModelForCausalLM.from_pretrained(out_dir)` knows which base model to load.
    """
    settings = getattr(model, SETTINGS_ATTR, None)
    if settings is None:
        raise ValueError("export_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    config = _peft_lora_config(model, settings, base_model_name_or_path)
    if hasattr(getattr(model, "config", None), "model_type"):
        _check_peft_keeps_targets(model, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(peft_adapter_state_dict(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
