"""``moetune.AutoModelForCausalLM``: Transformers' auto class with moetune's implementations.

For an architecture moetune implements (``moetune.models.FAMILIES``) the model is built on the
meta device, the checkpoint is checked against it from the safetensors headers alone, the model
is sharded if ``ep_size`` / ``device_mesh`` asks for it, and only then is memory allocated and
each process's part of the weights read. Every other architecture goes to Transformers unchanged.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from moetune.checkpoint import (
    list_checkpoint_tensors,
    load_checkpoint,
    plan_checkpoint_load,
    rename_checkpoint_tensors,
    unused_parameter_names,
)
from moetune.integrations import IMPLEMENTATION_NAME, register_moetune_experts
from moetune.integrations.transformers_experts import set_fallback_experts_backend
from moetune.models import ModelFamily, family_for, set_moe_options
from moetune.models.options import check_experts_backend
from moetune.options import MoetuneOptions

HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "subfolder", "proxies")
# Transformers' loading arguments that moetune accepts and ignores (their effect is built in).
IGNORED_LOADING_KWARGS = ("low_cpu_mem_usage", "use_safetensors", "weights_only", "_from_auto")


class AutoModelForCausalLM(transformers.AutoModelForCausalLM):
    """Drop-in for ``transformers.AutoModelForCausalLM`` (same arguments, plus ``MoetuneOptions``)."""

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any):
        options = MoetuneOptions.pop_from(kwargs)
        family = family_for(config)
        if family is None:
            _check_fallback_options(config, options)
            _prefer_moetune_experts(config, kwargs, options.experts_backend)
            return _with_fallback_experts_backend(
                transformers.AutoModelForCausalLM.from_config(config, **kwargs), options.experts_backend
            )
        if kwargs.get("attn_implementation") is None:
            kwargs["attn_implementation"] = _attention_for(config, family)
        if options.distributed:
            from moetune.distributed import parallelize_for_options

            with torch.device("meta"):
                model = family.causal_lm._from_config(config, **kwargs)
            set_moe_options(model, balanced_gate=options.balanced_gate, experts_backend=options.experts_backend)
            return parallelize_for_options(model, options, init_weights=True)
        model = family.causal_lm._from_config(config, **kwargs)
        set_moe_options(model, balanced_gate=options.balanced_gate, experts_backend=options.experts_backend)
        return _with_lora(model, options)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any):
        options = MoetuneOptions.pop_from(kwargs)
        fallback_kwargs = dict(kwargs)
        hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
        trust_remote_code = kwargs.pop("trust_remote_code", None)
        config = kwargs.pop("config", None)
        dtype = kwargs.pop("dtype", None)
        torch_dtype = kwargs.pop("torch_dtype", None)
        dtype = dtype if dtype is not None else torch_dtype
        attn_implementation = kwargs.pop("attn_implementation", None)
        device_map = kwargs.pop("device_map", None)
        generation_config = kwargs.pop("generation_config", None)
        output_loading_info = kwargs.pop("output_loading_info", False)
        variant = kwargs.pop("variant", None)
        key_mapping = kwargs.pop("key_mapping", None)
        for name in IGNORED_LOADING_KWARGS:
            kwargs.pop(name, None)

        folder = resolve_checkpoint_folder(pretrained_model_name_or_path, **hub)
        config_overrides = set(kwargs)  # what is left are config fields (checked by _load_config)
        config_given = config is not None
        if config is None:
            config = _load_config(folder, trust_remote_code=trust_remote_code, overrides=kwargs)
        elif isinstance(config, (str, os.PathLike)):
            # A path to the config (or a Hub id), as Transformers takes it: loaded, then the
            # leftover keyword arguments override its fields.
            config = _load_config(_config_location(config, hub), trust_remote_code=trust_remote_code, overrides=kwargs)
        elif not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a PretrainedConfig or a path to one, got {type(config).__name__}")
        elif kwargs:
            raise TypeError(f"unexpected keyword arguments with an explicit config: {sorted(kwargs)}")
        else:
            # Loading sets dtype, _name_or_path and may drop quantization_config: do that to a copy,
            # as Transformers does, so the caller's config is unchanged and no two models share one.
            config = copy.deepcopy(config)
        family = family_for(config)
        method = _quantization_field(config, "quant_method")
        if family is not None and method is not None:
            if _dequantized_while_loading(config, method, family.causal_lm.checkpoint_layout):
                del config.quantization_config  # the model (and what it saves) holds plain weights
            else:
                warnings.warn(
                    f"checkpoint {str(folder)!r} is quantized (quant_method={method!r}): moetune's "
                    f"{config.model_type} implementation trains bf16 / fp32 weights, so it loads through Transformers' "
                    "class (which dequantizes or keeps the quantized weights as it always does). Dequantize it to bf16 "
                    "(e.g. Transformers' from_pretrained + save_pretrained) for moetune's kernels and expert parallelism.",
                    stacklevel=2,
                )
                family = None
        if family is None:
            _check_fallback_options(config, options)
            _prefer_moetune_experts(config, fallback_kwargs, options.experts_backend)
            for key in config_overrides:
                fallback_kwargs.pop(key)  # already applied to the config
            fallback_kwargs["config"] = config
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                pretrained_model_name_or_path, *model_args, **fallback_kwargs
            )
            _with_fallback_experts_backend(loaded[0] if isinstance(loaded, tuple) else loaded, options.experts_backend)
            return loaded
        if model_args:
            raise TypeError(f"{family.causal_lm.__name__} takes no positional model arguments, got {model_args!r}")
        attn_implementation = attn_implementation or _attention_for(config, family)

        tensors = list_checkpoint_tensors(folder, variant=variant)
        if key_mapping is not None:
            tensors = rename_checkpoint_tensors(tensors, key_mapping)
        dtype = resolve_dtype(dtype, config, tensors)
        device = resolve_device(device_map, distributed=options.distributed)
        config.dtype = dtype
        config._name_or_path = str(pretrained_model_name_or_path)
        with torch.device("meta"):
            model = family.causal_lm._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        # A caller who made the model shallower than the checkpoint (num_hidden_layers=N, a shorter
        # layer pattern, or a config of its own) gets the first layers; the tensors of the others are
        # left unread, as Transformers leaves them. Otherwise every tensor must have a place, except
        # the multi-token-prediction layers DeepSeek-V3's files store after the checkpoint's last layer.
        callers_config = config_given or bool(config_overrides)
        num_checkpoint_layers = config.num_hidden_layers
        if callers_config:
            num_checkpoint_layers = _load_config(folder, trust_remote_code=trust_remote_code, overrides={}).num_hidden_layers
        unused: list[str] | None = [] if callers_config and config.num_hidden_layers < num_checkpoint_layers else None
        plan = plan_checkpoint_load(  # raises before allocation
            model, tensors, model.checkpoint_layout, unused=unused, num_checkpoint_layers=num_checkpoint_layers
        )
        unexpected = unused_parameter_names(unused, model, model.checkpoint_layout) if unused else set()
        if unexpected:
            warnings.warn(
                f"{len(unexpected)} parameters in {str(folder)!r} belong to decoder layers beyond the model's "
                f"{config.num_hidden_layers} (num_hidden_layers) and were not loaded: {', '.join(sorted(unexpected)[:4])}, ...",
                stacklevel=2,
            )
        set_moe_options(model, balanced_gate=options.balanced_gate, experts_backend=options.experts_backend)
        if options.distributed:
            from moetune.distributed import parallelize_for_options

            model = parallelize_for_options(model, options, init_weights=False)
        else:
            materialize(model, device)
        load_checkpoint(model, plan)
        model.generation_config = _generation_config(folder, model, generation_config)
        model.eval()
        model = model if options.distributed else _with_lora(model, options)
        if output_loading_info:  # Transformers' report; anything else missing or unexpected raised above
            return model, {"missing_keys": set(), "unexpected_keys": unexpected, "mismatched_keys": set(), "error_msgs": []}
        return model


def _attention_for(config: PretrainedConfig, family: ModelFamily) -> str:
    """The attention a caller named in the config (``AutoConfig.from_pretrained(..., attn_implementation=
    "eager")``, stored as ``_attn_implementation_internal``, None unless set, in Transformers 5.x),
    else the family's default."""
    return getattr(config, "_attn_implementation", None) or family.default_attention


def _config_location(config: str | os.PathLike, hub: dict[str, Any]) -> Path:
    """``from_pretrained(config=<path>)``: a config file, a folder holding config.json, or a Hub repo."""
    path = Path(config).expanduser()
    if path.is_file():
        return path
    try:
        return resolve_checkpoint_folder(config, patterns=("config.json",), **hub)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"config {str(config)!r} is neither a config file nor a folder or Hub repo holding config.json"
        ) from None


def _dequantized_while_loading(config: PretrainedConfig, method: str, layout) -> bool:
    """MXFP4 experts (GPT-OSS) and 128 x 128 block-scaled FP8 (DeepSeek-V3, Kimi-K2, Qwen3 "-FP8")
    are dequantized by moetune's loader."""
    if method == "mxfp4":
        return layout.mxfp4_experts
    block = _quantization_field(config, "weight_block_size")
    return method == "fp8" and layout.fp8_block_scaled and list(block or []) == [128, 128]


def _quantization_field(config: PretrainedConfig, name: str) -> Any:
    """A field of the checkpoint's ``quantization_config`` (a dict or an object), None without one;
    ``quant_method`` is "unknown" when a quantization_config does not name it."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    value = quantization.get(name) if isinstance(quantization, dict) else getattr(quantization, name, None)
    return str(value or "unknown") if name == "quant_method" else value


def _with_lora(model, options: MoetuneOptions):
    if options.lora is None:
        return model
    from moetune.lora import apply_lora

    return apply_lora(model, options.lora)


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Allocate a meta-device model on ``device`` (uninitialised) and recompute its non-persistent
    buffers (RoPE frequencies), which no checkpoint stores."""
    model.to_empty(device=device)
    rebuild_non_persistent_buffers(model, device)
    if hasattr(model, "tie_weights"):  # to_empty gives each module its own tensor, untying lm_head
        model.tie_weights()


@torch.no_grad()
def rebuild_non_persistent_buffers(model: torch.nn.Module, device: torch.device | str) -> None:
    for name, module in model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        if not (type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config")):
            raise AssertionError(f"don't know how to rebuild non-persistent buffers of {name} ({type(module).__name__})")
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for buffer_name in module._non_persistent_buffers_set:
            getattr(module, buffer_name).copy_(getattr(fresh, buffer_name))


CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")


def resolve_checkpoint_folder(
    name_or_path: str | os.PathLike, *, patterns: tuple[str, ...] = CHECKPOINT_PATTERNS, **hub: Any
) -> Path:
    """A local folder as is; a Hub repo id downloaded (the files matching ``patterns``: safetensors
    and JSON by default) into the cache."""
    path = Path(name_or_path).expanduser()
    subfolder = hub.pop("subfolder", "") or ""
    if path.is_dir():
        return path / subfolder if subfolder else path
    text = str(name_or_path)
    if path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or path.exists():
        raise FileNotFoundError(f"checkpoint folder {text!r} does not exist")
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/{p}" for p in patterns] if subfolder else list(patterns)
    hub.pop("proxies", None)
    folder = Path(snapshot_download(repo_id=text, allow_patterns=patterns, **hub))
    return folder / subfolder if subfolder else folder


# Hub model types whose remote-code config is one of Transformers' classes (Kimi-K2 ships
# DeepSeek-V3's architecture under its own model_type).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def _load_config(folder: Path, *, trust_remote_code: bool | None, overrides: dict[str, Any]) -> PretrainedConfig:
    """The config in ``folder``'s config.json (or in ``folder`` itself, a config file)."""
    path = folder if folder.is_file() else folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(folder)!r}")
    data = json.loads(path.read_text())
    alias = MODEL_TYPE_ALIASES.get(data.get("model_type"))
    try:
        if alias is not None and not trust_remote_code:  # Transformers' own class, no remote code
            fields = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
            config_class = type(AutoConfig.for_model(alias))
            config, unused = config_class.from_dict(fields, return_unused_kwargs=True, **overrides)
        else:
            config, unused = AutoConfig.from_pretrained(
                folder, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **overrides
            )
    except (ValueError, KeyError) as error:
        raise ValueError(f"neither moetune nor Transformers can build the config in {str(folder)!r}: {error}") from error
    if unused:
        raise TypeError(f"unexpected keyword arguments (neither loading options nor config fields): {sorted(unused)}")
    overrides.clear()
    return config


def resolve_dtype(dtype: Any, config: PretrainedConfig, tensors: dict) -> torch.dtype:
    """Transformers v5 semantics: None / 'auto' -> the config's dtype, else the checkpoint's."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            float_dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
            dtype = next((float_dtypes[t.dtype] for t in tensors.values() if t.dtype in float_dtypes), None)
        dtype = dtype or torch.get_default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32' or 'auto')")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, a string naming one, or 'auto'; got {dtype!r}")
    return dtype


def resolve_device(device_map: Any, *, distributed: bool) -> torch.device:
    """One device: moetune places an unsharded model on a single device (like ``device_map='cuda:0'``)."""
    if distributed:
        if device_map not in (None, "auto"):
            raise ValueError("device_map cannot be combined with ep_size / device_mesh: each rank uses its own device")
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    if device_map is None:
        return torch.device("cpu")
    if device_map == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(
                f"device_map places modules on {len(devices)} devices; moetune places the model on one device "
                "and shards over several with ep_size / device_mesh"
            )
        device_map = devices.pop()
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)


def _generation_config(folder: Path, model, explicit: GenerationConfig | None) -> GenerationConfig:
    if explicit is not None:
        return explicit
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(model.config)


def _takes_experts_implementation(config: PretrainedConfig) -> bool:
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    return model_class is not None and model_class._can_set_experts_implementation()


def _prefer_moetune_experts(config: PretrainedConfig, kwargs: dict[str, Any], experts_backend: str) -> None:
    """Fallback MoE models that use Transformers' experts interface get moetune's experts path on
    CUDA (on CPU Transformers' default stays: its results are the reference), and wherever the
    caller picks an ``experts_backend``."""
    if experts_backend != "auto":  # _check_fallback_options made sure the model takes it
        chosen = kwargs.setdefault("experts_implementation", IMPLEMENTATION_NAME)
        if chosen != IMPLEMENTATION_NAME:
            raise ValueError(
                f"experts_backend={experts_backend!r} runs moetune's experts path; it cannot be combined with "
                f"experts_implementation={chosen!r}"
            )
        register_moetune_experts()
        return
    if "experts_implementation" in kwargs or not torch.cuda.is_available():
        return
    if _takes_experts_implementation(config):
        register_moetune_experts()
        kwargs["experts_implementation"] = IMPLEMENTATION_NAME


def _with_fallback_experts_backend(model, experts_backend: str):
    if experts_backend != "auto":
        set_fallback_experts_backend(model, experts_backend)
    return model


def _check_fallback_options(config: PretrainedConfig, options: MoetuneOptions) -> None:
    if options.distributed:
        raise ValueError(
            f"ep_size / device_mesh need an architecture moetune implements; {getattr(config, 'model_type', '?')!r} "
            "falls back to Transformers' class (shard it with FSDP2 yourself)"
        )
    if options.balanced_gate or options.lora is not None:
        raise ValueError(
            f"balanced_gate / lora apply to moetune's MoE models (use moetune.lora.apply_lora), not {getattr(config, 'model_type', '?')!r}"
        )
    if options.experts_backend != "auto":
        check_experts_backend(options.experts_backend)
        if not _takes_experts_implementation(config):
            raise ValueError(
                f"experts_backend applies to moetune's MoE models and to Transformers' MoE models that take an "
                f"experts implementation; {getattr(config, 'model_type', '?')!r} takes none"
            )
