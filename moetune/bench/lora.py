"""LoRA on both sides of the benchmark (``moetune bench --lora-rank R``): PEFT's adapters on the plain
Transformers model against moetune's (``moetune.lora``), on the same targets (the attention
projections the family has: q/k/v/o, or DeepSeek-V3's latent ones; and every expert's weights),
rank, alpha and adapter values.

The adapter values are drawn per moetune adapter name (seeded by the run's seed and the name, as
``init_weights`` draws the base weights), non-zero on both A and B so that the adapters take part
in the forward from the first step. PEFT gets exactly those values: moetune's ``apply_lora`` is
applied to the Transformers model first (it adapts plain Transformers v5 MoE models too), its
adapters are drawn and converted to PEFT's names and layouts (``peft_adapter_state_dict``, the
export that ``PeftModel.from_pretrained`` loads in the tests), then removed, and PEFT's own
adapters are created and loaded with them.

``--moetune-lora peft`` gives moetune's model PEFT's adapters instead (user code that keeps calling
``peft.get_peft_model`` after changing the import): PEFT folds the experts' deltas into the weights.

On several GPUs (torchrun), Transformers' side gets PEFT's adapters before FSDP2 wraps it
(``build_hf``), and moetune's side gets its own from ``from_config(..., lora=settings)``, which adds
them between expert parallelism and FSDP2; ``init_weights`` draws them by name as it draws every
parameter, the values ``init_adapters`` gives.
"""

from __future__ import annotations

from torch import nn

from moetune.bench.weights import init_weights
from moetune.lora import LoraSettings, apply_lora, lora_parameters, remove_lora

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def lora_settings(rank: int, alpha: float | None, config) -> LoraSettings:
    """The benchmark's adapters: the attention projections among ``ATTENTION_PROJECTIONS`` that
    ``config``'s model has, and the experts; alpha 2 x rank unless given."""
    from moetune.flops import meta_model

    present = {name.rpartition(".")[2] for name, module in meta_model(config).named_modules() if isinstance(module, nn.Linear)}
    targets = [name for name in ATTENTION_PROJECTIONS if name in present]
    return LoraSettings(rank=rank, alpha=float(2 * rank if alpha is None else alpha), target_modules=targets)


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """Each adapter tensor drawn as ``init_weights`` draws every weight: normal(0, 0.02) seeded by (seed, name)."""
    init_weights(model, seed=seed, parameters=lora_parameters(model))


def adapt_with_moetune_lora(model: nn.Module, settings: LoraSettings, *, seed: int) -> dict:
    apply_lora(model, settings)
    init_adapters(model, seed=seed)
    return lora_notes(model, "moetune.lora.apply_lora (expert adapters applied to the activations)")


def adapt_with_peft(model: nn.Module, settings: LoraSettings, *, seed: int) -> tuple[nn.Module, dict]:
    """The PEFT model around ``model`` (Transformers' or moetune's: user code that calls PEFT on the
    drop-in model) with the benchmark's adapters; raises if PEFT is missing or does not take every
    adapter."""
    try:
        from peft import get_peft_model, set_peft_model_state_dict
    except ImportError as error:
        raise RuntimeError("--lora-rank on the Transformers side needs the `peft` package (pip install peft)") from error
    from moetune.lora.peft_export import _peft_lora_config, peft_adapter_state_dict

    apply_lora(model, settings)
    init_adapters(model, seed=seed)
    config = _peft_lora_config(model, settings, None)
    adapters = peft_adapter_state_dict(model)
    remove_lora(model)
    for param in model.parameters():  # remove_lora leaves every weight trainable; PEFT freezes the base itself
        param.requires_grad_(False)
    config.inference_mode = False
    peft_model = get_peft_model(model, config)
    result = set_peft_model_state_dict(peft_model, adapters)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeError(f"PEFT did not take {len(unexpected)} adapter tensors, e.g. {unexpected[:3]}")
    peft_model.train()
    return peft_model, lora_notes(peft_model, "peft.get_peft_model (LoraConfig with target_modules and target_parameters)")


def lora_notes(model: nn.Module, how: str) -> dict:
    """How the adapters were added, and the (global) numbers of trainable and frozen parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"lora": how, "trainable_parameters": trainable,
            "frozen_parameters": sum(p.numel() for p in model.parameters() if not p.requires_grad)}  # fmt: skip
