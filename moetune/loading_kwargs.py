"""Transformers v5's ``from_pretrained`` keyword arguments, and what moetune does with each.

This applies to the architectures moetune implements (``moetune.models.family_for``). Every other
architecture, and a checkpoint that Transformers' own class must load (a quantization moetune does
not dequantize), goes to ``transformers.AutoModelForCausalLM.from_pretrained`` with all of its
arguments unchanged.

``ARGUMENTS`` is the one table: each argument of Transformers 5.25's ``PreTrainedModel.from_pretrained``
(its signature and what it pops from ``**kwargs``; 5.10 lacks ``kernels_mode``, ``tp_plan`` and
``tp_size``), how moetune treats it and why. ``pop_loading_arguments`` takes them all out of the
keyword arguments; what is left are config fields (``num_hidden_layers=2``), as in Transformers.

Treatments:

- ``hub``: passed to the Hub download (``huggingface_hub.snapshot_download``) of a repo id.
- ``supported``: Transformers' meaning, on the one device (or the expert-parallel shards) moetune
  loads onto; ``why`` says how.
- ``ignored``: accepted with no effect, because what it asks for is already the case.
- ``warned``: accepted; a value other than the default gets a warning saying it is not applied.
- ``refused``: a value other than the defaults listed is a ``ValueError`` naming the argument and
  what to use instead, raised once the config is read and before any weight is downloaded or read.
- ``moetune``: moetune's own ``MoetuneOptions`` field with Transformers' name (moetune's meaning).

``FROM_CONFIG_ARGUMENTS`` does the same for ``from_config(config, **kwargs)``: what Transformers'
``AutoModelForCausalLM.from_config`` (``trust_remote_code``) and ``PreTrainedModel._from_config``
(the rest) take, 5.10 and 5.25 alike; anything else goes to the model class's ``__init__`` there,
which for these architectures takes only the config (a ``TypeError``), and is a ``TypeError`` here
too, naming what from_config takes (``unexpected_from_config_arguments``).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any

HUB, SUPPORTED, IGNORED, WARNED, REFUSED, MOETUNE = "hub", "supported", "ignored", "warned", "refused", "moetune"

_ONE_DEVICE = (
    "moetune places the model on one device (device_map='cuda:0', 'auto' or 'cpu') and shards it over several "
    "GPUs with expert parallelism + FSDP2 (ep_size=N or device_mesh=..., under torchrun)"
)
_TENSOR_PARALLEL = (
    "tensor parallelism: moetune shards MoE models with expert parallelism + FSDP2 instead (ep_size=N or device_mesh=...)"
)
_PEFT = (
    "moetune loads no PEFT adapter inside from_pretrained: load the base model, then "
    "moetune.lora.load_peft_adapter(model, adapter_dir) (or train new adapters with lora=LoraSettings(...))"
)
_HUB_KERNELS = "Transformers' Hub kernels, which moetune does not apply (see use_kernels)"


@dataclass(frozen=True)
class Argument:
    name: str
    treatment: str
    why: str
    defaults: tuple = (None,)
    """Transformers' default first; for ``refused`` / ``warned`` the values accepted silently."""

    @property
    def default(self) -> Any:
        return self.defaults[0]


ARGUMENTS: tuple[Argument, ...] = (
    # Where the files come from.
    Argument("revision", HUB, "the Hub revision to download"),
    Argument("cache_dir", HUB, "the Hub cache folder"),
    Argument("token", HUB, "the Hub token"),
    Argument("local_files_only", HUB, "never download", (False,)),
    Argument("force_download", HUB, "download again even if cached", (False,)),
    Argument("subfolder", HUB, "the checkpoint's folder inside the repo (or the local folder)", ("",)),
    Argument("proxies", HUB, "accepted and dropped: huggingface_hub >= 1.0 takes proxies from HTTP(S)_PROXY"),
    Argument("tqdm_class", HUB, "the progress bar class of the Hub download (Transformers uses it only there)"),
    Argument("_commit_hash", IGNORED, "Transformers 5.25 ignores it too: `revision` names what is downloaded"),
    Argument("_from_auto", IGNORED, "Hub telemetry only", (False,)),
    Argument("_from_pipeline", IGNORED, "Hub telemetry only"),
    # What is built.
    Argument(
        "config", SUPPORTED,
        "a PretrainedConfig, or a path / Hub id of one; leftover keyword arguments then override its fields",
    ),
    Argument("trust_remote_code", SUPPORTED, "for the config (moetune's model classes are its own, never remote code)"),
    Argument(
        "dtype", SUPPORTED,
        "None / 'auto': the config's dtype, else the checkpoint's; or a torch dtype or its name; the modules the class "
        "names in _keep_in_fp32_modules (for fp16) and _keep_in_fp32_modules_strict (fp16, bf16) stay fp32, as in Transformers",
    ),
    Argument("torch_dtype", SUPPORTED, "the old name of `dtype` (`dtype` wins when both are given)"),
    Argument("attn_implementation", SUPPORTED, "the attention the model runs (default: the family's)"),
    Argument(
        "experts_implementation", SUPPORTED,
        "moetune's experts run their own kernels, chosen by experts_backend: 'eager' (Transformers' per-expert loop) "
        "selects experts_backend='loop', 'grouped_mm' selects 'auto' (torch's grouped GEMM where it runs, CUDA bf16, "
        "else the loop, as Transformers' grouped_mm falls back), 'moetune' keeps experts_backend; Transformers' other "
        "registered kernels (batched_mm, sonicmoe, deepgemm, ...) are for its own experts modules: a warning says "
        "experts_backend runs instead (same results); unknown names and a contradicting experts_backend are a ValueError",
    ),
    Argument("key_mapping", SUPPORTED, "regex renames of the checkpoint's tensor names, as Transformers applies them"),
    Argument(
        "fusion_config", SUPPORTED,
        "recorded in the config as Transformers records it; Transformers' only fusion (patch_embeddings) fuses vision "
        "patch embeddings, which moetune's text models do not have, so nothing changes; an unknown fusion is a ValueError",
    ),
    Argument(
        "quantization_config", SUPPORTED,
        "dequantize=True (Mxfp4Config / FineGrainedFP8Config) on a checkpoint moetune dequantizes while loading (MXFP4 "
        "experts, 128 x 128 block-scaled FP8) or on an unquantized one: moetune's model with plain weights; any other "
        "(quantizing while loading: bitsandbytes, torchao, ...; or keeping a checkpoint quantized): Transformers' "
        "class with the argument, after a warning (moetune trains bf16 / fp32 weights). Training in FP8 is moetune's "
        "own option fp8='rowwise' / 'blockwise' (MoetuneOptions), which also loads the block-scaled FP8 checkpoints "
        "(DeepSeek-V3, Kimi-K2: dequantized to the bf16 master weights, then quantized again in each step)",
    ),
    # Where the model goes.
    Argument(
        "device_map", SUPPORTED,
        "one device: a device, an int, 'auto' (cuda:0, else cpu) or a dict naming one device; left out, the device of "
        "a `with torch.device(...)` block or torch's default device, as in Transformers (the meta device is a "
        "RuntimeError, as in Transformers); " + _ONE_DEVICE,
    ),
    Argument("device_mesh", MOETUNE, "moetune's DeviceMesh for expert parallelism + FSDP2 (Transformers': tensor parallelism)"),
    Argument("max_memory", REFUSED, "a per-device memory budget for Accelerate's multi-device placement: " + _ONE_DEVICE),
    Argument("offload_folder", REFUSED, "Accelerate's disk offload: " + _ONE_DEVICE),
    Argument("offload_buffers", REFUSED, "Accelerate's CPU offload: " + _ONE_DEVICE, (False, None)),
    Argument("tp_plan", REFUSED, _TENSOR_PARALLEL),
    Argument("tp_size", REFUSED, _TENSOR_PARALLEL),
    Argument("distributed_config", REFUSED, "Transformers' FSDP2 / " + _TENSOR_PARALLEL),
    # What is read.
    Argument(
        "state_dict", SUPPORTED,
        "a dict of tensors loaded instead of files, with pretrained_model_name_or_path=None and config=... (as in "
        "Transformers); checked against the model like a checkpoint's files, in the Hub or the fused layout",
    ),
    Argument("variant", SUPPORTED, "the variant's safetensors files (model.<variant>.safetensors, its index)"),
    Argument(
        "ignore_mismatched_sizes", SUPPORTED,
        "parameters whose checkpoint shape differs are left unread, initialised by the model's _init_weights and "
        "listed in a warning and in output_loading_info's mismatched_keys; without it they are an error",
        (False,),
    ),
    Argument(
        "disable_mmap", SUPPORTED,
        "True reads each safetensors file whole into memory with plain reads instead of memory-mapping it (a file and "
        "the file of its FP8 / MXFP4 scales at a time); None / False memory-map (Transformers' None also detects "
        "hf-mount filesystems)",
    ),
    Argument(
        "use_safetensors", REFUSED,
        "moetune reads safetensors only and never unpickles: convert pickled weights (save_pretrained)", (None, True),
    ),
    Argument("weights_only", IGNORED, "restricts unpickling, and moetune never unpickles (safetensors only)", (True,)),
    Argument(
        "gguf_file", SUPPORTED,
        "a GGUF file holds its own config and quantized weights, and moetune reads safetensors: the call goes to "
        "Transformers' class (which dequantizes it), with a warning, as for the other quantizations moetune does not "
        "dequantize; with moetune's options (ep_size, lora, ...) it is a ValueError",
    ),
    Argument(
        "output_loading_info", SUPPORTED,
        "also return Transformers' report: missing, unexpected and mismatched keys, error messages; asking for it takes "
        "Transformers' semantics for what it reports: parameters the checkpoint lacks are initialised (with a warning) "
        "and listed in missing_keys, tensors no parameter takes are listed in unexpected_keys. Without it either is a "
        "ValueError naming the tensors (Transformers would only log them)", (False,),
    ),
    Argument("generation_config", SUPPORTED, "the model's generation config instead of the checkpoint's generation_config.json"),
    # Adapters and kernels.
    Argument("adapter_name", REFUSED, "the name of a PEFT adapter loaded with the model: " + _PEFT, ("default", None)),
    Argument("adapter_kwargs", REFUSED, "Hub arguments of a PEFT adapter loaded with the model: " + _PEFT, (None, {})),
    Argument(
        "use_kernels", WARNED,
        "Transformers' Hub kernels replace the forwards of its own layers; moetune's models run moetune's kernels "
        "(experts_backend, the fused LM-head loss), so none is applied",
        (None, False),
    ),
    Argument("kernel_config", WARNED, "the mapping of " + _HUB_KERNELS),
    Argument("kernels_mode", WARNED, "the mode of " + _HUB_KERNELS),
    Argument(
        "allow_all_kernels", SUPPORTED,
        "the model is built under Transformers' allow_all_hub_kernels(), so attn_implementation may name any Hub "
        "kernel, as in Transformers", (False,),
    ),
    # Arguments Transformers v5 drops without a word.
    Argument("low_cpu_mem_usage", IGNORED, "moetune always builds on the meta device and reads each tensor once"),
    *(
        Argument(name, IGNORED, "Transformers v5 drops it too")
        for name in ("mirror", "_fast_init", "from_tf", "from_flax", "offload_state_dict")
    ),
)

_BY_NAME = {argument.name: argument for argument in ARGUMENTS}
HUB_ARGUMENTS = tuple(a.name for a in ARGUMENTS if a.treatment == HUB)

FROM_CONFIG_ARGUMENTS: tuple[Argument, ...] = (
    Argument(
        "trust_remote_code", IGNORED,
        "the config is built already, and moetune's model classes are its own, never remote code (Transformers' "
        "from_config uses it only for a config whose auto_map names remote code)",
    ),
    Argument("code_revision", IGNORED, "the revision of remote code, which moetune never runs (Transformers takes it only then)"),
    Argument(
        "dtype", SUPPORTED,
        "as Transformers' _from_config: the model is built with it as torch's default dtype (restored afterwards) and "
        "Transformers 5.25 records it as config.dtype; left out: config.dtype (None: torch's default); a torch dtype "
        "or its name; 'auto' (which Transformers' from_config does not take): config.dtype, as from_pretrained's "
        "'auto' means without a checkpoint",
    ),
    Argument(
        "torch_dtype", SUPPORTED,
        "the old name of `dtype` (the same values), as Transformers takes it: `dtype` wins unless it equals config.dtype",
    ),
    _BY_NAME["attn_implementation"],
    _BY_NAME["experts_implementation"],
    Argument(
        "allow_all_kernels", SUPPORTED,
        "lets attn_implementation name any Hub kernel, as Transformers' _from_config means it (Transformers' own "
        "from_config also passes it on to the model's __init__, a TypeError)",
        (False,),
    ),
    _BY_NAME["device_mesh"],
)


def _is_default(value: Any, defaults: tuple) -> bool:
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


class LoadingArguments:
    """The Transformers loading arguments a ``from_pretrained`` call passed (``pop_loading_arguments``)."""

    def __init__(self, given: dict[str, Any]) -> None:
        self.given = given

    def __getitem__(self, name: str) -> Any:
        """The value passed, else Transformers' default."""
        return self.given[name] if name in self.given else _BY_NAME[name].default

    @property
    def hub(self) -> dict[str, Any]:
        return {name: self.given[name] for name in HUB_ARGUMENTS if name in self.given}

    def check_for_moetune(self, model_type: str) -> None:
        """Refuse what moetune cannot honour for its own models, warn about what it does not apply, and
        check ``fusion_config``; called before any weight is read."""
        for name, value in self.given.items():
            argument = _BY_NAME[name]
            if argument.treatment == REFUSED and not _is_default(value, argument.defaults):
                raise ValueError(
                    f"from_pretrained({name}={_short(value)}) is not supported for moetune's {model_type}: {argument.why}"
                )
        kernels = [n for n in ("use_kernels", "kernel_config", "kernels_mode") if not _is_default(self[n], _BY_NAME[n].defaults)]
        if kernels:
            warnings.warn(
                f"{', '.join(kernels)}: Transformers' Hub kernels are not applied to moetune's {model_type}, which runs "
                "moetune's own kernels (the experts' picked with experts_backend)",
                stacklevel=3,
            )
        check_fusion_config(self["fusion_config"])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pop_loading_arguments(kwargs: dict[str, Any], arguments: tuple[Argument, ...] = ARGUMENTS) -> LoadingArguments:
    """Take every Transformers loading argument (of ``arguments``: from_pretrained's by default) out
    of ``kwargs`` (what is left: config fields for from_pretrained, nothing valid for from_config)."""
    names = [argument.name for argument in arguments if argument.treatment != MOETUNE]  # MoetuneOptions pops those
    return LoadingArguments({name: kwargs.pop(name) for name in names if name in kwargs})


def unexpected_from_config_arguments(names: list[str], config: Any) -> TypeError:
    """The error for keyword arguments ``from_config`` does not take (Transformers' model classes raise
    a TypeError for them too: ``__init__() got an unexpected keyword argument``)."""
    fields = [name for name in sorted(names) if hasattr(config, name)]
    loading = [name for name in sorted(names) if name in _BY_NAME and name not in fields]
    hints = []
    if fields:
        hints.append(
            f"{', '.join(fields)}: config fields, which from_config does not override (set them on the config first: "
            f"config.{fields[0]} = ...)"
        )
    if loading:
        hints.append(f"{', '.join(loading)}: from_pretrained's loading arguments, which from_config does not take")
    takes = ", ".join(a.name for a in FROM_CONFIG_ARGUMENTS if a.treatment != MOETUNE)
    return TypeError(
        f"from_config() got unexpected keyword arguments {sorted(names)} for moetune's {config.model_type} (a TypeError "
        f"in Transformers too, whose model class takes only the config); it takes {takes}, and MoetuneOptions' fields "
        "(ep_size, device_mesh, experts_backend, lora, fp8, ...)" + "".join(f"; {hint}" for hint in hints)
    )


def check_fusion_config(fusion_config: Any) -> None:
    """Transformers' check: a dict whose keys are fusions Transformers knows."""
    if fusion_config is None:
        return
    if not isinstance(fusion_config, dict):
        raise ValueError(f"fusion_config must be a dict of fusion name -> True or options, got {type(fusion_config).__name__}")
    try:
        from transformers.fusion_mapping import _FUSION_REGISTRY
    except ImportError:  # pragma: no cover - a Transformers without fusions
        known: set[str] = set()
    else:
        known = set(_FUSION_REGISTRY)
    unknown = sorted(set(fusion_config) - known)
    if unknown:
        raise ValueError(f"fusion_config: unknown fusion type(s) {unknown} (Transformers knows {sorted(known)})")


# Transformers' experts implementations and the experts_backend that does the same for moetune's experts.
EXPERTS_IMPLEMENTATIONS = {"eager": "loop", "grouped_mm": "auto"}


def experts_backend_for(
    experts_implementation: str | None, experts_backend: str, model_type: str, *, warn: bool = True
) -> str:
    """The experts_backend a moetune model runs, given Transformers' ``experts_implementation`` and
    moetune's ``experts_backend`` ('auto' when not given). ``warn``: say so when the name is one of
    Transformers' kernels for its own experts modules, which moetune's experts do not run."""
    from moetune.integrations import IMPLEMENTATION_NAME

    if experts_implementation is None or experts_implementation == IMPLEMENTATION_NAME:
        return experts_backend
    if experts_implementation in EXPERTS_IMPLEMENTATIONS:
        equivalent = EXPERTS_IMPLEMENTATIONS[experts_implementation]
        if experts_backend not in ("auto", equivalent, experts_implementation):
            raise ValueError(
                f"experts_implementation={experts_implementation!r} (moetune's experts_backend={equivalent!r}) contradicts "
                f"experts_backend={experts_backend!r}; pass one of them"
            )
        return experts_backend if experts_backend != "auto" else equivalent
    known = _transformers_experts_implementations()
    if experts_implementation not in known:
        raise ValueError(
            f"experts_implementation={experts_implementation!r} is not one of Transformers' experts implementations "
            f"{sorted(known | set(EXPERTS_IMPLEMENTATIONS))}; moetune's {model_type} picks its experts kernel with "
            "experts_backend ('auto', 'grouped_mm', 'triton', 'quack', 'loop')"
        )
    if warn:
        warnings.warn(
            f"experts_implementation={experts_implementation!r} is a kernel for Transformers' experts modules; moetune's "
            f"{model_type} runs its own experts with experts_backend={experts_backend!r} (the same results; pick another "
            "kernel with experts_backend)",
            stacklevel=3,
        )
    return experts_backend


def _transformers_experts_implementations() -> set[str]:
    """The names Transformers' ``get_correct_experts_implementation`` accepts besides 'eager'."""
    names: set[str] = set()
    for module, registry in (("moe", "ALL_EXPERTS_FUNCTIONS"), ("finegrained_fp8", "ALL_FP8_EXPERTS_FUNCTIONS")):
        try:
            names |= set(getattr(importlib.import_module(f"transformers.integrations.{module}"), registry).keys())
        except (ImportError, AttributeError):  # pragma: no cover - older / newer Transformers
            pass
    return names
