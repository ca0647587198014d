"""Which architectures moetune implements itself; everything else uses Transformers' classes."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from moetune.models.deepseek_v3.model import DeepseekV3ForCausalLM, DeepseekV3Model
from moetune.models.gpt_oss.model import GptOssForCausalLM, GptOssModel
from moetune.models.nemotron_h.model import NemotronHForCausalLM, NemotronHModel
from moetune.models.qwen3_moe.model import Qwen3MoeForCausalLM, Qwen3MoeModel


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    causal_lm: type[PreTrainedModel]
    base_model: type[PreTrainedModel]
    """The backbone (Transformers' ``XModel``), which ``causal_lm`` holds as ``model``."""
    is_moe: bool = True
    default_attention: str = "sdpa"
    """``attn_implementation`` when the caller names none (Transformers' GPT-OSS has no SDPA path)."""


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("qwen3_moe", Qwen3MoeForCausalLM, Qwen3MoeModel),
        # Kimi-K2 is this architecture (as a DeepseekV3Config)
        ModelFamily("deepseek_v3", DeepseekV3ForCausalLM, DeepseekV3Model),
        ModelFamily("gpt_oss", GptOssForCausalLM, GptOssModel, default_attention="eager"),
        ModelFamily("nemotron_h", NemotronHForCausalLM, NemotronHModel),  # Nemotron 3 Nano
    )
}


def family_for(config: PretrainedConfig) -> ModelFamily | None:
    """moetune's implementation of ``config``'s architecture, or None to fall back to Transformers."""
    return FAMILIES.get(getattr(config, "model_type", None))


def family_of_class(model_class: type) -> ModelFamily | None:
    """The family whose causal LM or backbone ``model_class`` is (or subclasses), else None."""
    return next(
        (f for f in FAMILIES.values() if issubclass(model_class, (f.causal_lm, f.base_model))),
        None,
    )
