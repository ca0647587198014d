"""Which architectures moetune implements itself; everything else uses Transformers' classes."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from moetune.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moetune.models.gpt_oss.model import GptOssForCausalLM
from moetune.models.nemotron_h.model import NemotronHForCausalLM
from moetune.models.qwen3_moe.model import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    causal_lm: type[PreTrainedModel]
    is_moe: bool = True
    default_attention: str = "sdpa"
    """``attn_implementation`` when the caller names none (Transformers' GPT-OSS has no SDPA path)."""


FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("qwen3_moe", Qwen3MoeForCausalLM),
        ModelFamily("deepseek_v3", DeepseekV3ForCausalLM),  # Kimi-K2 is this architecture (as a DeepseekV3Config)
        ModelFamily("gpt_oss", GptOssForCausalLM, default_attention="eager"),
        ModelFamily("nemotron_h", NemotronHForCausalLM),  # Nemotron 3 Nano
    )
}


def family_for(config: PretrainedConfig) -> ModelFamily | None:
    """moetune's implementation of ``config``'s architecture, or None to fall back to Transformers."""
    return FAMILIES.get(getattr(config, "model_type", None))
