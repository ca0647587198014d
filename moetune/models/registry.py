"""Which architectures moetune implements itself; everything else uses Transformers' classes (and
whether those are causal)."""

from __future__ import annotations

import inspect
import re
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


def transformers_causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """The class ``transformers.AutoModelForCausalLM`` builds for ``config``, or None if it takes none."""
    import transformers

    return transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)


def not_causal_reason(config: PretrainedConfig) -> str | None:
    """Why Transformers' causal-LM class for ``config`` would not be causal, or None.

    Encoders that Transformers also offers as causal LMs (BERT, RoBERTa, ELECTRA, ... as
    ``BertLMHeadModel``) mask attention causally only with ``is_decoder=True``; their class's
    ``__init__`` tests ``config.is_decoder`` and only logs a warning without it. Such a model,
    trained with next-token labels, sees the very tokens it predicts, and exports as if causal."""
    if family_for(config) is not None:
        return None
    model_class = transformers_causal_lm_class(config)
    if model_class is None:
        return (f"model_type {getattr(config, 'model_type', '?')!r} ({type(config).__name__}) has no causal-LM class in "
                "Transformers (AutoModelForCausalLM does not take it): it is an encoder or encoder-decoder model")
    try:
        source = inspect.getsource(model_class.__init__)
    except (OSError, TypeError):  # no source to read: nothing to say
        return None
    if re.search(r"\b(not|assert)\s+(self\.)?config\.is_decoder\b", source) and not getattr(config, "is_decoder", False):
        return (f"model_type {config.model_type!r}: {model_class.__name__} attends in both directions unless the config "
                "field is_decoder is true, and this config has is_decoder false (an encoder); trained on next-token "
                "labels it would see the tokens it predicts. Set is_decoder: true in its config.json to train it as a "
                "decoder, or choose a decoder model")
    return None
