"""Building the two sides of a benchmark on the same config, weights and routing.

- Transformers v5: ``transformers.AutoModelForCausalLM.from_config`` with sdpa attention (the
  family's default where Transformers has no SDPA path: GPT-OSS, eager, on both sides) and the
  grouped_mm experts backend on CUDA (eager elsewhere); on several GPUs FSDP2 ``fully_shard`` on
  every decoder layer and the root (the published v5 baseline, no expert parallelism).
- moetune: ``moetune.AutoModelForCausalLM.from_config`` (``balanced_gate``, ``ep_size=world`` on
  several GPUs).

Both models have the same parameter names and shapes, so ``init_weights`` gives them identical
weights without a copy: each parameter is filled from a generator seeded by (seed, name).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from moetune.bench.lora import adapt_with_moetune_lora, adapt_with_peft, lora_notes
from moetune.bench.weights import init_weights, sharded_weights_match
from moetune.moe.routing import balanced_assignment

SIDES = ("hf", "moetune")
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "assets" / "configs"


class SideUnavailable(RuntimeError):
    """This checkout cannot build a side (e.g. expert parallelism is missing); raised alike on every rank."""


def load_config(name_or_path: str, *, layers: int | None = None) -> tuple[str, transformers.PretrainedConfig]:
    """A shipped config by name (``qwen3_30b_a3b``, ``tiny``), a config.json, or a folder holding one.

    Returns (short name for result files, config with ``num_hidden_layers`` overridden by ``layers``).
    """
    path = config_path(name_or_path, what="--config")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type not in HF_ROUTERS:
        raise ValueError(f"moetune bench supports the model types moetune implements ({', '.join(HF_ROUTERS)}), got {model_type!r}")
    config = transformers.AutoConfig.from_pretrained(str(path))  # Transformers' reader (e.g. its encoding of inf)
    with_layers(config, layers)
    config.use_cache = False
    return short_name(path), config


def config_path(name_or_path: str, *, what: str) -> Path:
    """The config.json of a shipped config name, a config.json or a folder holding one; ``what`` names
    the argument in the error."""
    path = Path(name_or_path)
    shipped = CONFIGS_DIR / f"{name_or_path}.json"
    if shipped.is_file():
        path = shipped
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise ValueError(f"{what} {name_or_path!r}: neither a shipped config ({', '.join(known)}) nor a config.json")
    return path


def short_name(path: Path) -> str:
    """``qwen3-30b-a3b`` for a shipped config's file, the folder's name for a config.json."""
    name = path.stem if path.name != "config.json" else path.parent.name
    return name.replace("_", "-")


def with_layers(config: transformers.PretrainedConfig, layers: int | None) -> transformers.PretrainedConfig:
    """``config`` cut to its first ``layers`` layers, in place (None: unchanged)."""
    if layers is None:
        return config
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    if isinstance(getattr(config, "layer_types", None), list):
        # Per-layer kinds (GPT-OSS's sliding / full attention, Nemotron-H's pattern, where the
        # list's length is the number of layers): the first ``layers`` of them.
        config.layer_types = config.layer_types[:layers]
    config.num_hidden_layers = layers
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = min(config.max_window_layers, layers)
    return config


# Transformers' router class of each family, patched for the balanced gate (module, class name).
HF_ROUTERS = {
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter"),
    "nemotron_h": ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHTopkRouter"),
}


@contextlib.contextmanager
def hf_balanced_gate(*, enabled: bool, top_k: int, model_type: str = "qwen3_moe") -> Iterator[None]:
    """Transformers' router of ``model_type`` replaced by the balanced gate (slot j -> expert j mod E,
    weight 1/K) for the duration of the block, then restored. Router logits are still computed
    (as moetune's balanced gate does) so the routers' cost is the same on both sides."""
    if not enabled:
        yield
        return
    import importlib

    module_name, class_name = HF_ROUTERS[model_type]
    router_cls = getattr(importlib.import_module(module_name), class_name, None)
    if router_cls is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no {class_name} to patch for the balanced gate")
    original = router_cls.forward
    checked = False

    def balanced_forward(self, hidden_states: torch.Tensor):
        nonlocal checked
        if not checked:  # once: this Transformers version's router must return (logits, weights, experts)
            out = original(self, hidden_states)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise RuntimeError(
                    f"transformers {transformers.__version__}'s {class_name} returns logits only (the routing "
                    "happens elsewhere): --routing balanced cannot patch it; use --routing real"
                )
            checked = True
        # The logits as each family's router computes them (fp32 routers hold fp32 weights; GPT-OSS
        # adds a bias), and nothing else, as moetune's balanced gate.
        x_TH = hidden_states.reshape(-1, self.weight.shape[-1]).to(self.weight.dtype)
        logits_TE = F.linear(x_TH, self.weight, getattr(self, "bias", None))
        weights_TK, experts_TK = balanced_assignment(
            logits_TE.shape[0], num_experts=logits_TE.shape[-1], top_k=top_k, device=logits_TE.device,
            dtype=logits_TE.dtype,
        )  # fmt: skip
        return logits_TE, weights_TK, experts_TK

    router_cls.forward = balanced_forward
    try:
        yield
    finally:
        router_cls.forward = original


@dataclass
class BenchModel:
    """One side of the benchmark: a built model and how to switch its routing."""

    side: str
    model: nn.Module
    config: transformers.PretrainedConfig
    routing_context: Callable[[bool], contextlib.AbstractContextManager]
    """``routing_context(balanced)``: the block runs with the balanced gate (True) or real routing."""
    notes: dict[str, Any] = field(default_factory=dict)
    """What was actually built (experts backend, sharding), recorded in the results."""
    activation_checkpointing: bool = False

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The training loss exactly as a user's loop gets it: labels = input ids, ``out.loss``."""
        return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Transformers' per-decoder-layer checkpointing (non-reentrant), the same call on both sides.
        Transformers 5.24 renamed ``gradient_checkpointing_*`` to ``activation_checkpointing_*``."""
        model = self.model
        if enabled == self.activation_checkpointing:
            return
        if enabled:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
        self.activation_checkpointing = enabled


def attention_for(config: transformers.PretrainedConfig) -> str:
    """sdpa, or the family's default where Transformers has no SDPA path (GPT-OSS: eager), on both sides."""
    from moetune.models import family_for

    family = family_for(config)
    return family.default_attention if family is not None else "sdpa"


def hf_experts_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """grouped_mm on CUDA in bf16 (the published v5 setting), eager elsewhere (no CPU grouped GEMM)."""
    return "grouped_mm" if device.type == "cuda" and dtype == torch.bfloat16 else "eager"


def build_hf(
    config: transformers.PretrainedConfig,
    *,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int,
    world_size: int = 1,
    experts_implementation: str | None = None,
    round_to: torch.dtype | None = None,
    lora: Any = None,
) -> BenchModel:
    """``lora``: a ``LoraSettings`` for PEFT's adapters (``moetune.bench.lora``), added before FSDP2."""
    config = copy.deepcopy(config)
    requested = experts_implementation or hf_experts_implementation(device, dtype)
    config._experts_implementation = requested
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_for(config))
    init_weights(model, seed=seed, round_to=round_to)  # before sharding: plain tensors
    notes: dict[str, Any] = {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "requested_experts_implementation": requested,
    }
    if lora is not None:  # before FSDP2, which shards only the parameters that exist when it runs
        model, peft_notes = adapt_with_peft(model, lora, seed=seed)
        notes.update(peft_notes)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for layer in unwrap_peft(model).model.layers:
            _fully_shard_by_dtype(layer, fully_shard, mesh)
        fully_shard(model, mesh=mesh)
        notes["sharding"] = f"FSDP2 fully_shard on every decoder layer and the root, {world_size} ranks, no EP"
    model.train()
    top_k, model_type = config.num_experts_per_tok, config.model_type
    return BenchModel(
        "hf", model, config, lambda balanced: hf_balanced_gate(enabled=balanced, top_k=top_k, model_type=model_type),
        notes=notes,
    )


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model inside PEFT's ``PeftModel`` (``--lora-rank`` with PEFT), else ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _fully_shard_by_dtype(module: nn.Module, fully_shard: Callable, mesh) -> None:
    """``fully_shard(module)``; FSDP2 wants one dtype per group, so where the module's parameters
    mix dtypes (DeepSeek-V3's and Nemotron-H's fp32 routers, Mamba-2's fp32 A_log / D in a bf16
    layer), its children are sharded first, each the same way, and the module keeps the rest.

    With PEFT's adapters: containers without a forward (its ``ModuleDict`` of adapters) are not
    sharded themselves, their children are; and its expert wrapper (``ParamWrapper``), which reads
    the wrapped experts' weights outside their own forward, is one unit with them, gathered in the
    weights' dtype (its fp32 adapters included) and reduced in fp32."""
    if isinstance(module, (nn.ModuleDict, nn.ModuleList)):
        for child in module.children():
            if next(child.parameters(), None) is not None:
                _fully_shard_by_dtype(child, fully_shard, mesh)
        return
    if type(module).__name__ == "ParamWrapper":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        weight_dtype = min((p.dtype for p in module.parameters()), key=lambda d: torch.finfo(d).bits)
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=weight_dtype, reduce_dtype=torch.float32))
        return
    if len({p.dtype for p in module.parameters()}) > 1:
        for child in module.children():
            if next(child.parameters(), None) is not None:
                _fully_shard_by_dtype(child, fully_shard, mesh)
    fully_shard(module, mesh=mesh)


def build_moetune(
    config: transformers.PretrainedConfig,
    *,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int,
    world_size: int = 1,
    balanced_gate: bool = False,
    round_to: torch.dtype | None = None,
    options: dict[str, Any] | None = None,
    rebalance_seq_len: int | None = None,
    compile_layers: bool = False,
    lora: Any = None,
    lora_with_peft: bool = False,
) -> BenchModel:
    """``options``: extra ``MoetuneOptions`` for ``from_config`` (e.g. ``ep_capacity_factor``).
    ``lora``: a ``LoraSettings`` for moetune's adapters (``moetune.bench.lora``; PEFT's with
    ``lora_with_peft``, one process only); on several GPUs ``from_config`` adds moetune's between expert
    parallelism and FSDP2.
    ``compile_layers``: ``torch.compile`` each decoder layer (inductor; under expert parallelism the
    experts run eagerly inside).
    ``rebalance_seq_len``: relabel the experts so that the expert-parallel ranks get balanced loads
    (``moetune.distributed.placement``), counted on one calibration sequence of this length per rank
    (other tokens than the measured ones)."""
    import moetune
    from moetune.models import set_moe_options

    config = copy.deepcopy(config)
    options = dict(options or {})
    notes: dict[str, Any] = {"options": dict(options)} if options else {}
    # moetune's eager rows stay eager (the graphed rows replay moetune's whole step instead); the
    # graphs that replay the decoder stack under a user's own loop: --moetune-option cuda_graphs=True.
    options.setdefault("cuda_graphs", False)
    if world_size > 1:
        _require_expert_parallelism()
        options.setdefault("ep_size", world_size)
        if lora is not None:
            if lora_with_peft:
                raise SideUnavailable("--moetune-lora peft runs in one process: PEFT cannot wrap a model that "
                                      "from_config has already sharded")
            options["lora"] = lora  # added between expert parallelism and FSDP2; init_weights draws them
        model = moetune.AutoModelForCausalLM.from_config(config, dtype=dtype, balanced_gate=balanced_gate, **options)
        dense = "replicated non-expert parameters" if options.get("dense_parallel") == "replicate" else "FSDP2"
        notes["sharding"] = (
            f"moetune expert parallelism ep_size={options['ep_size']} ({options.get('ep_dispatch', 'alltoall')}) "
            f"+ {dense} (moetune.distributed)"
        )
    else:
        with torch.device(device):
            model = moetune.AutoModelForCausalLM.from_config(
                config, dtype=dtype, balanced_gate=balanced_gate, **options
            )
    init_weights(model, seed=seed, round_to=round_to)
    if world_size > 1:
        notes["sharded_weights_match"] = sharded_weights_match(model, seed=seed)
    if rebalance_seq_len:  # counted with the real router, whatever the first row's routing
        set_moe_options(model, balanced_gate=False)
        notes["expert_placement"] = _rebalance(model, config, device=device, seed=seed, seq_len=rebalance_seq_len,
                                               num_ranks=options.get("ep_size", world_size))  # fmt: skip
        set_moe_options(model, balanced_gate=balanced_gate)
    if lora is not None and world_size > 1:
        notes.update(lora_notes(model, "moetune.lora through from_config(lora=...), between expert parallelism and FSDP2"))
    elif lora is not None:
        if lora_with_peft:
            model, peft_notes = adapt_with_peft(model, lora, seed=seed)
            notes.update(peft_notes)
        else:
            notes.update(adapt_with_moetune_lora(model, lora, seed=seed))
    if compile_layers:
        from moetune.distributed.parallelize import decoder_layers

        for layer in decoder_layers(model):
            layer.compile()
        notes["compiled"] = "each decoder layer (torch.compile, inductor)"
    base = unwrap_peft(model)
    notes["class"] = f"{type(base).__module__}.{type(base).__name__}"
    notes["experts_backend"] = _moetune_experts_backend(model, device, dtype)
    model.train()

    @contextlib.contextmanager
    def routing(balanced: bool) -> Iterator[None]:
        set_moe_options(model, balanced_gate=balanced)
        yield

    return BenchModel("moetune", model, config, routing, notes=notes)


def _rebalance(model, config, *, device: torch.device, seed: int, seq_len: int, num_ranks: int) -> dict[str, Any]:
    """Relabel the experts for balanced expert-parallel loads; returns the busiest rank's routed rows
    over the mean, averaged over the MoE layers, before and after (on the calibration tokens)."""
    import torch.distributed as dist

    from moetune.distributed.placement import expert_loads, rebalance_experts, rows_per_rank

    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator(device=device).manual_seed(seed + 1_000_000 + rank)  # not the measured tokens
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator, device=device)
    loads = expert_loads(model, [{"input_ids": ids}])
    orders = rebalance_experts(model, loads, num_ranks=num_ranks)

    def busiest(rows: torch.Tensor) -> float:
        per_rank = rows_per_rank(rows, num_ranks).float()
        return (per_rank.max() / per_rank.mean()).item()

    before = [busiest(loads[name]) for name in orders]
    after = [busiest(loads[name][order]) for name, order in orders.items()]
    return {"num_ranks": num_ranks, "calibration_tokens_per_rank": seq_len,
            "busiest_rank_over_mean_before": round(sum(before) / len(before), 4) if before else None,
            "busiest_rank_over_mean_after": round(sum(after) / len(after), 4) if after else None}  # fmt: skip


def build_side(side: str, config: transformers.PretrainedConfig, **kwargs: Any) -> BenchModel:
    if side == "hf":
        kwargs.pop("balanced_gate", None)
        kwargs.pop("options", None)
        kwargs.pop("rebalance_seq_len", None)
        kwargs.pop("compile_layers", None)
        kwargs.pop("lora_with_peft", None)
        return build_hf(config, **kwargs)
    if side == "moetune":
        return build_moetune(config, **kwargs)
    raise ValueError(f"unknown side {side!r} (expected one of {SIDES})")


def _require_expert_parallelism() -> None:
    try:
        from moetune.distributed import parallelize_for_options  # noqa: F401
    except ImportError as error:
        raise SideUnavailable(
            "moetune's expert parallelism (moetune.distributed.parallelize_for_options) is not available in this "
            f"checkout ({error}); run the multi-GPU benchmark with --sides hf, or on one GPU"
        ) from error


def _moetune_experts_backend(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    from moetune.moe import GroupedExperts
    from moetune.moe.experts import grouped_mm_supported

    backends = {m.backend for m in model.modules() if isinstance(m, GroupedExperts)}
    if backends != {"auto"}:
        return ",".join(sorted(backends))
    probe = torch.empty(0, dtype=dtype, device=device)
    return "auto (grouped_mm)" if grouped_mm_supported(probe) else "auto (loop)"
