"""Build the model and tokenizer a job asks for, on the job's device and dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from moetune import AutoModelForCausalLM
from moetune.checkpoint import list_checkpoint_tensors
from moetune.layers.activation_checkpointing import enable_activation_checkpointing
from moetune.models.registry import not_causal_reason
from moetune.recipe.config import ModelConfig
from moetune.utils.json_files import read_json


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    path = config.tokenizer_path or config.pretrained_path
    field = "model.tokenizer_path" if config.tokenizer_path else "model.pretrained_path"
    if not Path(path).is_dir():
        raise ValueError(f"{field}: tokenizer directory {path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ValueError(f"{field}: the tokenizer in {path} has no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # only pads; padded positions carry no label
    return tokenizer


def load_model_config(config: ModelConfig) -> PretrainedConfig:
    """The model's Transformers config, with the job's overrides applied."""
    field = "model.pretrained_path" if config.pretrained_path else "model.config_path"
    path = Path(config.pretrained_path or config.config_path)
    if not path.exists():
        raise ValueError(f"{field}: {path} does not exist")
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{field}: {path} holds no config.json")
    try:  # Transformers' own error names the file but not where in it
        read_json(config_file)
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
    model_config = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    if config.router_aux_loss_coef is not None:
        if not hasattr(model_config, "router_aux_loss_coef"):
            raise ValueError("model.router_aux_loss_coef: this model has no MoE load-balancing loss")
        model_config.router_aux_loss_coef = config.router_aux_loss_coef
    return model_config


def check_weight_files(config: ModelConfig) -> None:
    """``model.pretrained_path``'s safetensors files, read from their headers (a damaged or truncated
    file is named, with its shard, before any data is read), for every architecture: moetune's
    loader reads them so, Transformers' (for the others) would name no file. A folder of other
    formats is left to Transformers."""
    folder = Path(config.pretrained_path) if config.pretrained_path else None
    if folder is None or not folder.is_dir() or not any(folder.glob("*.safetensors")):
        return
    try:
        list_checkpoint_tensors(folder)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"model.pretrained_path: {err}") from None


_RECURRENT_MIXERS = ("Mamba", "GatedDeltaNet")
"""Class-name marks of layers that carry a state along the sequence (Mamba-2 / SSM, linear attention)."""


def check_model_for_job(model_config: PretrainedConfig, *, packing: bool, cuda_graph: bool,
                        tokenizer_size: int | None = None) -> bool:
    """What the job asks of the model, checked on the meta device before anything is loaded; returns
    whether its attention takes packed documents' offsets (``takes_document_offsets``).

    - A causal LM: an encoder's "causal LM" class (BERT's with ``is_decoder`` false) attends to the
      tokens it is trained to predict (``moetune.models.registry.not_causal_reason``).
    - Every token id of the tokenizer (``tokenizer_size`` of them) has a row in the input embedding;
      an id beyond it would fail with an IndexError mid-run (in evaluation, or on a rare token).

    - Packed rows need every layer to keep documents apart. Attention does (offsets or a mask);
      Transformers' recurrent layers (Mamba-2 and the like) carry their state and convolution across
      the boundary, so one document would leak into the next (measured: the second document's logits
      moved by 0.1 on a tiny Transformers Nemotron-H). moetune's Nemotron-H keeps each document
      apart in them (``keeps_packed_documents_apart``); other models with such layers are refused.
    - A CUDA-graph step cannot capture Transformers' mask preparation for packed rows (it reads the
      positions on the host): it needs an attention that takes the offsets."""
    from moetune.flops import meta_model

    reason = not_causal_reason(model_config)
    if reason is not None:
        raise ValueError(f"model: not a causal LM: {reason}")
    model = meta_model(model_config)
    if tokenizer_size is not None:
        rows = model.get_input_embeddings().weight.shape[0]
        if tokenizer_size > rows:
            raise ValueError(
                f"model.tokenizer_path: the tokenizer has {tokenizer_size} tokens but the model's input embedding has "
                f"{rows} rows (vocab_size {getattr(model_config, 'vocab_size', '?')}): token ids {rows} and above have no "
                "embedding. Use the model's own tokenizer, or a model config with vocab_size >= "
                f"{tokenizer_size}")
    takes_offsets = bool(getattr(getattr(model, "model", None), "takes_document_offsets", False))
    if packing and not getattr(model, "keeps_packed_documents_apart", False):
        mixers = sorted({type(m).__name__ for m in model.modules() if any(mark in type(m).__name__ for mark in _RECURRENT_MIXERS)})
        if mixers:
            raise ValueError(
                f"config field data.packing: {model_config.model_type} has recurrent layers ({', '.join(mixers)}) that "
                "carry their state from one packed document into the next (they take no document boundaries); set "
                "data.packing false (one sample per row, padded)")
    if cuda_graph and not takes_offsets:
        raise ValueError(
            f"config field training.cuda_graph: {type(model).__name__} derives packed rows' attention masks on the "
            "host, which a CUDA graph cannot capture; moetune's architectures (Qwen3-MoE, DeepSeek-V3, GPT-OSS, "
            "Nemotron-H) take the documents' offsets instead. Set "
            "training.cuda_graph false for this model.")
    return takes_offsets


def build_model(config: ModelConfig, *, model_config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device, sharding: dict | None = None) -> PreTrainedModel:
    """From ``pretrained_path`` (weights loaded) or from ``config_path`` (random init, seeded by
    the caller), in train mode. ``sharding`` (moetune's ``ep_size`` / ``ep_overlap_chunks`` /
    ``lora`` / ``reduce_dtype`` options) returns a model already sharded over the ranks, each reading
    only its own weights."""
    # The recipe's own step decides about CUDA graphs (training.cuda_graph: the whole step, optimizer included).
    kwargs = {"dtype": dtype, "cuda_graphs": False}
    if config.attn_implementation:
        kwargs["attn_implementation"] = config.attn_implementation
    if config.experts_backend != "auto":  # MoE models only: from_pretrained refuses it for others by name
        kwargs["experts_backend"] = config.experts_backend
    if config.fp8:  # moetune's architectures only: refused for others, and where no FP8 kernel runs
        kwargs.update(fp8=config.fp8, fp8_backend=config.fp8_backend, fp8_weight_grad=config.fp8_weight_grad)
    if config.pretrained_path:
        placement = sharding if sharding else {"device_map": str(device)}
        model = AutoModelForCausalLM.from_pretrained(config.pretrained_path, config=model_config,
                                                     **placement, **kwargs)
    elif sharding:
        model = AutoModelForCausalLM.from_config(model_config, **sharding, **kwargs)
    else:
        with torch.device(device):  # built (and randomly initialised) where it trains: no host copy
            model = AutoModelForCausalLM.from_config(model_config, **kwargs)
        model.to(device)
    if config.activation_checkpointing:
        enable_activation_checkpointing(model, config.activation_checkpointing_mode)
    model.train()
    return model


def model_fingerprint(model_config: PretrainedConfig) -> dict:
    """What must match for a checkpoint to resume into this model: architecture and shapes, of
    every family moetune implements (a key the config lacks is left out)."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
            "num_local_experts", "num_experts_per_tok", "mlp_only_layers", "decoder_sparse_step",
            "tie_word_embeddings",
            # DeepSeek-V3 / Kimi-K2: routed and shared experts, dense first layers, MLA's ranks
            "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "n_group",
            "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            # Nemotron-H: which layer is Mamba-2, attention or MoE, and the mixers' shapes
            "hybrid_override_pattern", "layers_block_type", "mamba_num_heads", "mamba_head_dim",
            "ssm_state_size", "n_groups", "conv_kernel", "moe_shared_expert_intermediate_size")
    d = model_config.to_dict()
    return {k: d[k] for k in keys if k in d}
