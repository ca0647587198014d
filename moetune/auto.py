"""``moetune.AutoModelForCausalLM``: Transformers' auto class with moetune's implementations.

For an architecture moetune implements (``moetune.models.FAMILIES``) the model is built on the
meta device, the checkpoint is checked against it from the safetensors headers alone, the model
is sharded if ``ep_size`` / ``device_mesh`` asks for it, and only then is memory allocated and
each process's part of the weights read. Every other architecture goes to Transformers unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PretrainedConfig
from transformers.integrations.hub_kernels import allow_all_hub_kernels

from moetune.checkpoint import (
    list_checkpoint_tensors,
    load_checkpoint,
    plan_checkpoint_load,
    rename_checkpoint_tensors,
    unused_parameter_names,
)
from moetune.checkpoint.files import TensorInfo, state_dict_tensors
from moetune.checkpoint.loader import TensorReader, initialize_afresh
from moetune.checkpoint.tied import retie_equal, untie_where_both_are_held
from moetune.distributed import parallelize_for_options
from moetune.integrations import IMPLEMENTATION_NAME, register_moetune_experts
from moetune.integrations.transformers_experts import set_fallback_experts_backend
from moetune.loading_kwargs import (
    FROM_CONFIG_ARGUMENTS,
    experts_backend_for,
    pop_loading_arguments,
    unexpected_from_config_arguments,
)
from moetune.fp8.settings import check_fp8_hardware
from moetune.models import ModelFamily, family_for, family_of_class, set_moe_options
from moetune.models.fp8 import enable_fp8
from moetune.models.options import check_experts_backend
from moetune.models.pretrained import MoetunePreTrainedMixin
from moetune.models.registry import not_causal_reason, transformers_causal_lm_class
from moetune.options import MoetuneOptions
from moetune.training.graphed_backbone import set_training_graphs
from moetune.utils.json_files import read_json
from moetune.utils.materialize import materialize


class AutoModelForCausalLM(transformers.AutoModelForCausalLM):
    """Drop-in for ``transformers.AutoModelForCausalLM`` (same arguments, plus ``MoetuneOptions``)."""

    @classmethod
    def from_config(cls, config: PretrainedConfig, **kwargs: Any):
        """Transformers v5's arguments (``FROM_CONFIG_ARGUMENTS`` in ``moetune/loading_kwargs.py`` says
        what each does here) plus ``MoetuneOptions``. As Transformers' from_config, the model holds
        ``config`` itself, which gets the attention and experts implementations (and, in 5.25, the dtype)."""
        options = MoetuneOptions.pop_from(kwargs)
        config = as_implemented_config(config)
        family = family_for(config)
        if family is None:
            _check_fallback_options(config, options)
            _warn_if_not_causal(config, stacklevel=2)
            _prefer_moetune_experts(config, kwargs, options.experts_backend)
            return _with_fallback_experts_backend(
                transformers.AutoModelForCausalLM.from_config(config, **kwargs), options.experts_backend
            )
        check_fp8_hardware(options.fp8_settings)
        arguments = pop_loading_arguments(kwargs, FROM_CONFIG_ARGUMENTS)
        if kwargs:
            raise unexpected_from_config_arguments(list(kwargs), config)
        experts_backend = experts_backend_for(arguments["experts_implementation"], options.experts_backend, config.model_type)
        build = {"attn_implementation": arguments["attn_implementation"] or _attention_for(config, family)}
        for name in ("dtype", "torch_dtype"):  # Transformers' _from_config picks between them
            if name in arguments.given:
                value = arguments.given[name]
                build[name] = config.dtype if isinstance(value, str) and value == "auto" else as_torch_dtype(value, name)
        with contextlib.ExitStack() as building:
            if arguments["allow_all_kernels"]:  # as Transformers' _from_config (which cannot forward it to __init__)
                building.enter_context(allow_all_hub_kernels())
            if options.distributed:
                building.enter_context(torch.device("meta"))
            model = family.causal_lm._from_config(config, **build)
        set_moe_options(model, balanced_gate=options.balanced_gate, experts_backend=experts_backend)
        enable_fp8(model, options.fp8_settings)
        set_training_graphs(model, options.cuda_graphs)
        if options.distributed:
            return parallelize_for_options(model, options, init_weights=True)
        return _with_lora(model, options)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | None, *model_args: Any, **kwargs: Any):
        """Transformers v5's arguments (``moetune/loading_kwargs.py`` says what each does here) plus
        ``MoetuneOptions``; ``pretrained_model_name_or_path=None`` with ``config`` and ``state_dict``
        loads tensors given in memory."""
        return load_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)


def load_pretrained(
    pretrained_model_name_or_path: str | os.PathLike | None, *model_args: Any, model_class: type | None = None, **kwargs: Any
):
    """``from_pretrained`` of ``moetune.AutoModelForCausalLM`` (``model_class`` None: the architecture's
    class, moetune's or Transformers') and of moetune's model classes (``model_class``: the causal LM or
    the backbone of a family, e.g. ``moetune.models.qwen3_moe.model.Qwen3MoeModel``), which load the
    same way: a checkpoint that moetune's class cannot hold is an error naming the tensors, never
    parameters left as initialised."""
    options = MoetuneOptions.pop_from(kwargs)
    fallback_kwargs = dict(kwargs)
    loading = pop_loading_arguments(kwargs)  # what is left are config fields (checked by _load_config)
    path, hub, state_dict = pretrained_model_name_or_path, loading.hub, loading["state_dict"]
    _check_weights_source(path, state_dict, loading["config"])
    if loading["gguf_file"] is not None:
        return _load_gguf_with_transformers(path, model_args, fallback_kwargs, options, model_class)
    # The config first (of a Hub repo, only its JSON files): whether moetune implements the
    # architecture, and so what the arguments mean, is known before any weight is fetched or read.
    config_files = ("*.json", "*.py") if loading["trust_remote_code"] else ("*.json",)  # remote code's config class
    folder = None if path is None else resolve_checkpoint_folder(path, patterns=config_files, **hub)
    trust_remote_code, config = loading["trust_remote_code"], loading["config"]
    config_overrides = set(kwargs)
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
        config = copy.deepcopy(as_implemented_config(config))
    _check_class_for_config(model_class, config)
    family = _family_for_quantization(config, family_for(config), loading["quantization_config"], path)
    if family is None:
        return _load_with_transformers(path, model_args, fallback_kwargs, config, config_overrides, options, model_class)
    model_class = model_class or family.causal_lm
    if model_args:
        raise TypeError(f"{model_class.__name__} takes no positional model arguments, got {model_args!r}")
    if issubclass(model_class, family.base_model) and options.distributed:
        raise ValueError(
            f"ep_size / device_mesh shard moetune's causal LMs: load {family.causal_lm.__name__} and use its `model`, "
            f"not {model_class.__name__}"
        )
    loading.check_for_moetune(config.model_type)  # refuses what moetune cannot honour, before any weight is read
    check_fp8_hardware(options.fp8_settings)
    experts_backend = experts_backend_for(loading["experts_implementation"], options.experts_backend, config.model_type)
    attn_implementation = loading["attn_implementation"] or _attention_for(config, family)
    if loading["fusion_config"] is not None:
        config.fusion_config = copy.deepcopy(loading["fusion_config"])  # as Transformers records it

    if state_dict is not None:
        tensors = state_dict_tensors(state_dict)
    else:
        folder = resolve_checkpoint_folder(path, **hub)  # a Hub repo's weights are downloaded now
        tensors = list_checkpoint_tensors(folder, variant=loading["variant"])
    if loading["key_mapping"] is not None:
        tensors = rename_checkpoint_tensors(tensors, loading["key_mapping"])
    tensors, head_tensors = tensors_for_class(tensors, family, model_class)
    dtype = loading["dtype"] if loading["dtype"] is not None else loading["torch_dtype"]
    dtype = resolve_dtype(dtype, config, tensors)
    device = resolve_device(loading["device_map"], distributed=options.distributed)
    config.dtype = dtype
    config._name_or_path = "" if path is None else str(path)
    with torch.device("meta"), allow_all_hub_kernels() if loading["allow_all_kernels"] else contextlib.nullcontext():
        model = model_class._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        keep_in_fp32(model, dtype)
    # A caller who made the model shallower than the checkpoint (num_hidden_layers=N, a shorter
    # layer pattern, or a config of its own) gets the first layers; the tensors of the others are
    # left unread, as Transformers leaves them. Otherwise every tensor must have a place, except
    # the multi-token-prediction layers DeepSeek-V3's files store after the checkpoint's last layer.
    # A state dict comes with the caller's config: layers beyond it are left unread and reported.
    callers_config = config_given or bool(config_overrides)
    if state_dict is not None:
        unused, num_checkpoint_layers = [], None
    else:
        num_checkpoint_layers = config.num_hidden_layers
        if callers_config:
            num_checkpoint_layers = _load_config(folder, trust_remote_code=trust_remote_code, overrides={}).num_hidden_layers
        unused = [] if callers_config and config.num_hidden_layers < num_checkpoint_layers else None
    mismatched: list | None = [] if loading["ignore_mismatched_sizes"] else None
    # A caller who asks for Transformers' loading report gets Transformers' semantics: what the checkpoint
    # lacks is initialised and reported, what it has beyond the model is reported. Otherwise either is an error.
    report: dict | None = {} if loading["output_loading_info"] else None
    untied = untie_where_both_are_held(model, tensors, model.checkpoint_layout)
    plan = plan_checkpoint_load(  # raises before allocation
        model, tensors, model.checkpoint_layout, unused=unused, num_checkpoint_layers=num_checkpoint_layers,
        mismatched=mismatched, report=report,
    )  # fmt: skip
    source = "the state_dict" if folder is None else repr(str(folder))
    unexpected = unused_parameter_names(unused, model, model.checkpoint_layout) if unused else set()
    if head_tensors:
        # Transformers' AutoModel on a ForCausalLM checkpoint: the head is not part of the backbone.
        warnings.warn(
            f"{len(head_tensors)} tensors of {source} are outside {model_class.__name__} (the checkpoint's head) and "
            f"were not loaded: {', '.join(sorted(head_tensors)[:4])}",
            stacklevel=2,
        )
    if unexpected:
        warnings.warn(
            f"{len(unexpected)} parameters in {source} belong to decoder layers beyond the model's "
            f"{config.num_hidden_layers} (num_hidden_layers) and were not loaded: {', '.join(sorted(unexpected)[:4])}, ...",
            stacklevel=2,
        )
    set_moe_options(model, balanced_gate=options.balanced_gate, experts_backend=experts_backend)
    enable_fp8(model, options.fp8_settings)
    set_training_graphs(model, options.cuda_graphs)
    if options.distributed:
        model = parallelize_for_options(model, options, init_weights=False)
    else:
        materialize(model, device)
    load_checkpoint(model, plan, TensorReader(state_dict, mmap=not loading["disable_mmap"]))
    retie_equal(model, untied, source)
    if report and report["missing"]:
        warnings.warn(
            f"{len(report['missing'])} parameters of {type(model).__name__} are not in {source} and were initialised "
            f"afresh (output_loading_info=True reports them as missing_keys): {', '.join(sorted(report['missing'])[:4])}",
            stacklevel=2,
        )
    if mismatched or (report and report["missing"]):
        # As Transformers does: the model's own init for what the checkpoint did not fill (ignore_mismatched_sizes,
        # output_loading_info), with a report.
        initialize_afresh(model, {name for name, _, _ in mismatched or ()} | (report or {}).get("missing", set()))
    if mismatched:
        listing = ", ".join(f"{name}: {list(theirs)} in the checkpoint, {list(ours)} here" for name, theirs, ours in mismatched)
        warnings.warn(
            f"{len(mismatched)} parameters of {type(model).__name__} have other shapes in {source} and were "
            f"initialised afresh (ignore_mismatched_sizes=True): {listing}",
            stacklevel=2,
        )
    if model.can_generate():
        model.generation_config = _generation_config(folder, model, loading["generation_config"])
    model.eval()
    model = model if options.distributed else _with_lora(model, options)
    if loading["output_loading_info"]:  # Transformers' report; anything else missing or unexpected raised above
        unexpected = unexpected | set(head_tensors) | report["unexpected"]
        info = {"missing_keys": report["missing"], "unexpected_keys": unexpected, "mismatched_keys": set(mismatched or ()),
                "error_msgs": []}  # fmt: skip
        return model, info
    return model


def keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Transformers' ``_keep_in_fp32_modules`` (for fp16) and ``_keep_in_fp32_modules_strict`` (for fp16 and
    bf16): the parameters and buffers of the modules they name stay fp32 (GPT-OSS's norms, DeepSeek-V3's router)."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return
    pattern = re.compile(r"(?:^|\.)(?:" + "|".join(map(re.escape, sorted(names))) + r")(?:\.|$)")
    for module_name, module in model.named_modules():
        for registry in (module._parameters, module._buffers):
            for name, tensor in registry.items():
                full_name = f"{module_name}.{name}" if module_name else name
                if tensor is not None and tensor.is_floating_point() and pattern.search(full_name):
                    registry[name] = tensor.float() if registry is module._buffers else torch.nn.Parameter(
                        tensor.float(), requires_grad=tensor.requires_grad
                    )


def _check_weights_source(path: str | os.PathLike | None, state_dict: Any, config: Any) -> None:
    """Transformers' rule: weights come from a checkpoint path or, with ``path=None``, from ``state_dict``
    (and then ``config`` says what to build)."""
    if state_dict is not None and path is not None:
        raise ValueError(
            "state_dict cannot be passed together with a checkpoint name or path (as in Transformers): "
            "from_pretrained(None, config=config, state_dict=state_dict)"
        )
    if path is None and state_dict is None:
        raise ValueError("pretrained_model_name_or_path is None: pass a checkpoint, or config=... and state_dict=...")
    if path is None and config is None:
        raise ValueError("from_pretrained(None, state_dict=...) needs config=... (a PretrainedConfig or a path to one)")


def _family_for_quantization(config: PretrainedConfig, family: ModelFamily | None, requested: Any, path) -> ModelFamily | None:
    """``family``, or None where Transformers' class must load the checkpoint: a quantized checkpoint
    moetune does not dequantize, or a ``quantization_config`` argument other than asking for plain
    weights (``dequantize=True``: ``Mxfp4Config`` on MXFP4 experts, ``FineGrainedFP8Config`` on
    block-scaled FP8, which moetune dequantizes anyway, or either on an unquantized checkpoint):
    quantizing while loading (bitsandbytes, torchao, ...) or keeping the checkpoint's quantization
    are Transformers' (with a warning)."""
    method = _quantization_field(config, "quant_method")
    if family is None or (method is None and requested is None):
        return family
    layout = family.causal_lm.checkpoint_layout
    dequantizable = method is not None and _dequantized_while_loading(config, method, layout)
    if requested is None and dequantizable:
        del config.quantization_config  # the model (and what it saves) holds plain weights
        return family
    if requested is not None:
        asked = _quantization_value(requested, "quant_method")
        if _quantization_value(requested, "dequantize") and (method is None or (dequantizable and asked == method)):
            if method is not None:
                del config.quantization_config
            return family  # plain weights, as Transformers' dequantize=True gives
        if method is None:
            what = f"quantization_config (quant_method={asked!r}) asks to quantize the weights while loading"
        else:
            what = f"quantization_config (quant_method={asked!r}) for a checkpoint quantized with {method!r} " + (
                "keeps it quantized (dequantize=True gives plain weights)" if asked == method else "(Transformers' class decides)"
            )
    else:
        what = f"checkpoint {'the state_dict' if path is None else repr(str(path))} is quantized (quant_method={method!r})"
    warnings.warn(
        f"{what}: moetune's {config.model_type} implementation trains bf16 / fp32 weights, so it loads through "
        "Transformers' class (which quantizes, dequantizes or keeps the quantized weights as it always does). Load a "
        "bf16 checkpoint (dequantize one with Transformers' from_pretrained + save_pretrained) for moetune's kernels "
        "and expert parallelism.",
        stacklevel=3,
    )
    return None


def _load_with_transformers(path, model_args, kwargs: dict[str, Any], config: PretrainedConfig, config_overrides: set[str],
                            options: MoetuneOptions, model_class: type | None = None):  # fmt: skip
    """An architecture moetune does not implement (or a checkpoint Transformers' class must load):
    Transformers' auto class (or, for one of moetune's classes, the Transformers class it subclasses)
    with every argument as given, and the config already loaded."""
    _check_fallback_options(config, options)
    _warn_if_not_causal(config, stacklevel=3)
    _prefer_moetune_experts(config, kwargs, options.experts_backend)
    for key in config_overrides:
        kwargs.pop(key)  # already applied to the config
    kwargs["config"] = config
    if model_class is not None:
        loaded = transformers_class(model_class).from_pretrained(path, *model_args, **kwargs)
    elif path is None:  # Transformers' auto class needs a name; its model classes take None with a state_dict
        loaded = transformers.AutoModelForCausalLM._model_mapping[type(config)].from_pretrained(None, *model_args, **kwargs)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path, *model_args, **kwargs)
    _with_fallback_experts_backend(loaded[0] if isinstance(loaded, tuple) else loaded, options.experts_backend)
    return loaded


def _load_gguf_with_transformers(path, model_args, kwargs: dict[str, Any], options: MoetuneOptions, model_class: type | None):
    """A GGUF file holds its own config and quantized weights: Transformers' class reads and
    dequantizes it, as for the other quantizations moetune does not dequantize."""
    if options != MoetuneOptions():
        raise ValueError(
            "gguf_file loads through Transformers' class, which takes none of moetune's options (ep_size, device_mesh, "
            "experts_backend, lora, ...): load it with Transformers, save_pretrained, and load that folder with moetune"
        )
    warnings.warn(
        "gguf_file: moetune reads safetensors checkpoints, so the GGUF file loads through Transformers' class (which "
        "dequantizes it). For moetune's implementation of an MoE architecture, save_pretrained the model and load that folder.",
        stacklevel=3,
    )
    loader = transformers.AutoModelForCausalLM if model_class is None else transformers_class(model_class)
    return loader.from_pretrained(path, *model_args, **kwargs)


def transformers_class(model_class: type) -> type:
    """The Transformers class a moetune model class subclasses (``Qwen3MoeForCausalLM`` for moetune's)."""
    return next(base for base in model_class.__mro__ if base.__module__.startswith("transformers."))


def _check_class_for_config(model_class: type | None, config: PretrainedConfig) -> None:
    """A moetune class loads only a checkpoint of its own architecture (Transformers would build it
    from another architecture's config and leave most of it as initialised)."""
    if model_class is None:
        return
    family = family_of_class(model_class)
    if family is None or family_for(config) is not family:
        raise ValueError(
            f"{model_class.__name__} cannot load a checkpoint of model_type {getattr(config, 'model_type', None)!r}; "
            "moetune.AutoModelForCausalLM.from_pretrained picks the class for it"
        )


def tensors_for_class(tensors: dict[str, TensorInfo], family: ModelFamily, model_class: type) -> tuple[dict[str, TensorInfo], list[str]]:
    """The checkpoint's tensors under ``model_class``'s names, as Transformers bridges a backbone's and a
    causal LM's checkpoints by the backbone's attribute (``base_model_prefix``, ``model``): a backbone
    reads a causal LM's ``model.*`` tensors without the prefix (the keys of the others, the head, are
    returned to report), a causal LM reads a backbone's tensors with it. Same-class checkpoints as they are."""
    layout, head = family.causal_lm.checkpoint_layout, f"{model_class.base_model_prefix}."
    has_prefix = any(layout.canonical(key).startswith(head) for key in tensors)
    if issubclass(model_class, family.base_model) and has_prefix:
        inside = {layout.canonical(k)[len(head) :]: info for k, info in tensors.items() if layout.canonical(k).startswith(head)}
        return inside, [k for k in tensors if not layout.canonical(k).startswith(head)]
    if issubclass(model_class, family.causal_lm) and tensors and not has_prefix:
        return {head + layout.canonical(k): info for k, info in tensors.items()}, []
    return tensors, []


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
    return _quantization_value(quantization, name) if quantization else None


def _quantization_value(quantization: Any, name: str) -> Any:
    """A field of a quantization config, a dict or a Transformers ``QuantizationConfigMixin``
    (whose ``quant_method`` is an enum: its value, "mxfp4")."""
    value = quantization.get(name) if isinstance(quantization, dict) else getattr(quantization, name, None)
    if name == "quant_method":
        return str(getattr(value, "value", value) or "unknown")
    return value


def _with_lora(model, options: MoetuneOptions):
    if options.lora is None:
        return model
    from moetune.lora import apply_lora

    return apply_lora(model, options.lora)


CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py")


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


def _aliased_config(alias: str, fields: dict[str, Any], **kwargs: Any):
    """Transformers' own config class of model type ``alias`` from another model type's fields
    (``from_dict``'s keyword arguments pass through)."""
    own_fields = {k: v for k, v in fields.items() if k not in ("model_type", "auto_map")}
    return type(AutoConfig.for_model(alias)).from_dict(own_fields, **kwargs)


def as_implemented_config(config: PretrainedConfig) -> PretrainedConfig:
    """A config of a model type moetune implements under another name (``MODEL_TYPE_ALIASES``:
    Kimi-K2's remote-code config, built with ``trust_remote_code=True``) as Transformers' own
    config class of the same fields; any other config as it is."""
    alias = MODEL_TYPE_ALIASES.get(getattr(config, "model_type", None))
    if alias is None:
        return config
    return _aliased_config(alias, config.to_dict())


def _load_config(folder: Path, *, trust_remote_code: bool | None, overrides: dict[str, Any]) -> PretrainedConfig:
    """The config in ``folder``'s config.json (or in ``folder`` itself, a config file)."""
    path = folder if folder.is_file() else folder / "config.json"
    if not path.is_file() and (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} holds a PEFT adapter, not a model: load its base model (adapter_config.json's "
            "base_model_name_or_path), then moetune.lora.load_peft_adapter(model, adapter_dir)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(folder)!r}")
    data = read_json(path)  # a damaged file: named, with the line and column
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of config fields, got a {type(data).__name__}")
    alias = MODEL_TYPE_ALIASES.get(data.get("model_type"))
    try:
        if alias is not None:  # moetune implements it: Transformers' own config class, never the remote code's
            config, unused = _aliased_config(alias, data, return_unused_kwargs=True, **overrides)
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
    return as_torch_dtype(dtype)


def as_torch_dtype(dtype: Any, name: str = "dtype") -> torch.dtype | None:
    """A torch dtype given as itself or by its name ('bfloat16'), or None; else a ValueError naming the argument."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{name} {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32' or 'auto')")
        return resolved
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name} must be a torch.dtype, a string naming one, or 'auto'; got {dtype!r}")
    return dtype


def resolve_device(device_map: Any, *, distributed: bool) -> torch.device:
    """One device: moetune places an unsharded model on a single device (like ``device_map='cuda:0'``);
    without a ``device_map``, the device of a ``with torch.device(...)`` block or torch's default device,
    as Transformers places it (the meta device is refused: loading is for existing weights)."""
    if distributed:
        if device_map not in (None, "auto"):
            raise ValueError("device_map cannot be combined with ep_size / device_mesh: each rank uses its own device")
        from moetune.distributed.mesh import rank_device

        return rank_device()
    if device_map is None:
        return _context_device()
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
    if device_map in ("balanced", "balanced_low_0", "sequential", "disk"):
        raise ValueError(
            f"device_map={device_map!r} is Accelerate's placement over several devices (or offload to disk); moetune "
            "places the model on one device ('auto', 'cuda:0', 'cpu') and shards over several with ep_size / device_mesh"
        )
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)


def _context_device() -> torch.device:
    device = torch.empty(0).device  # a `with torch.device(...)` block, else torch's default device
    if device.type == "meta":
        raise RuntimeError(
            "You are using `from_pretrained` with a meta device context manager or `torch.set_default_device('meta')`"
            " (Transformers' words): loading reads existing weights. For an empty model on the meta device, use "
            "from_config (or the class) inside the block."
        )
    return device


def _generation_config(folder: Path | None, model, explicit: GenerationConfig | None) -> GenerationConfig:
    if explicit is not None:
        return explicit
    if folder is not None and (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(model.config)


def _takes_experts_implementation(config: PretrainedConfig) -> bool:
    model_class = transformers_causal_lm_class(config)
    return model_class is not None and model_class._can_set_experts_implementation()


def _warn_if_not_causal(config: PretrainedConfig, *, stacklevel: int) -> None:
    """An encoder built as a causal LM (BERT with ``is_decoder=False``): Transformers builds it and only
    logs a line; moetune builds it too (a drop-in does what Transformers does) but warns, naming the
    field. ``moetune finetune`` refuses it. A config Transformers has no causal-LM class for is left
    to Transformers' own error."""
    if transformers_causal_lm_class(config) is None:
        return
    reason = not_causal_reason(config)
    if reason is not None:
        warnings.warn(f"this causal LM is not causal: {reason}", UserWarning, stacklevel=stacklevel + 1)


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
    if options.fp8 is not None:
        raise ValueError(
            f"fp8={options.fp8!r} trains moetune's architectures (Qwen3-MoE, DeepSeek-V3 / Kimi-K2, GPT-OSS, Nemotron-H) in "
            f"FP8; {getattr(config, 'model_type', '?')!r} loads through Transformers' class, which moetune does not convert"
        )
    if options.experts_backend != "auto":
        check_experts_backend(options.experts_backend)
        if not _takes_experts_implementation(config):
            raise ValueError(
                f"experts_backend applies to moetune's MoE models and to Transformers' MoE models that take an "
                f"experts implementation; {getattr(config, 'model_type', '?')!r} takes none"
            )


# The model classes' own from_pretrained (Qwen3MoeForCausalLM.from_pretrained, ...) loads through the
# same function; they sit below this module, which hands it to them (moetune/models/pretrained.py).
MoetunePreTrainedMixin.loader = staticmethod(load_pretrained)

