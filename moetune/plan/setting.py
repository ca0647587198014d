"""What a plan is asked (``PlanRequest``) and what it chooses (``Setting``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

RECOMPUTE = ("auto", "none", "selective", "full")
PRECISIONS = ("bf16", "fp32_master", "fp32")
"""``bf16``: bf16 parameters, gradients and AdamW states (``training.precision: bf16``, the published
runs); ``fp32_master``: fp32 parameters, gradients and states with bf16 compute (``bf16_autocast``);
``fp32``: everything in fp32 (the recipe's default on CPU)."""
ROUTING = ("real", "balanced")


@dataclass(frozen=True)
class PlanRequest:
    model: str
    """A shipped config name (moetune/assets/configs), a config.json or a Hub-layout folder."""
    gpus_per_node: int = 8
    nodes: int = 1
    gpu: str = "h100"
    """The GPU type whose calibration to use (``h100``, ``h200``), or ``cpu`` (memory only)."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU; None: the calibration's (79.2 GiB for an H100 80GB, 139.8 for an H200)."""
    seq_len: int = 4096
    micro_batch: int | None = None
    """Sequences per micro-batch and GPU; None: the planner picks."""
    global_batch: int | None = None
    """Sequences per optimizer step over all GPUs; None: one micro-batch per GPU (no accumulation)."""
    lora_rank: int = 0
    """0: full fine-tuning; R: LoRA of rank R on the attention projections and every expert."""
    lora_targets: tuple[str, ...] = ()
    """LoRA's ``target_modules`` (name suffixes); empty: the attention projections the model has."""
    lora_experts: bool = True
    """LoRA on every expert's weights (``target_experts``)."""
    fp8: bool = False
    """FP8 GEMMs, priced by calibration ``fp8_*`` (fitted to measured H100 steps at 4k-32k tokens)."""
    recompute: str = "auto"
    ep: int | None = None
    dense_parallel: str | None = None
    precision: str = "bf16"
    routing: str = "real"
    layers: int | None = None
    """Plan a model cut to its first N layers (the validation proxies); None: the real depth."""
    optimizer: str = "moetune"
    """``moetune`` (one Triton kernel per tensor, the recipe's on GPU) or ``torch`` (fused AdamW)."""
    clip_grad: bool = True
    """The recipe clips the global gradient norm (one read of every gradient); the benchmark does not."""
    cuda_graph: bool | None = None
    """None: the planner decides where moetune can capture the step; False: eager only."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{field}: {message}")

        check(self.gpus_per_node >= 1, "gpus_per_node", f"must be >= 1, got {self.gpus_per_node}")
        check(self.nodes >= 1, "nodes", f"must be >= 1, got {self.nodes}")
        check(self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}")
        check(self.micro_batch is None or self.micro_batch >= 1, "micro_batch", f"must be >= 1, got {self.micro_batch}")
        check(self.global_batch is None or self.global_batch >= 1, "global_batch", f"must be >= 1, got {self.global_batch}")
        check(self.lora_rank >= 0, "lora_rank", f"must be >= 0, got {self.lora_rank}")
        check(self.recompute in RECOMPUTE, "recompute", f"{self.recompute!r} is not one of {RECOMPUTE}")
        check(self.precision in PRECISIONS, "precision", f"{self.precision!r} is not one of {PRECISIONS}")
        check(self.routing in ROUTING, "routing", f"{self.routing!r} is not one of {ROUTING}")
        check(self.ep is None or self.ep >= 1, "ep", f"must be >= 1, got {self.ep}")
        check(self.dense_parallel in (None, "fsdp", "replicate"), "dense_parallel",
              f"{self.dense_parallel!r} is not one of ('fsdp', 'replicate')")
        check(self.optimizer in ("moetune", "torch"), "optimizer", f"{self.optimizer!r} is not one of ('moetune', 'torch')")
        check(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "gpu_memory_gib", "must be > 0")
        check(self.layers is None or self.layers >= 1, "layers", f"must be >= 1, got {self.layers}")

    def but(self, **changes) -> PlanRequest:
        return replace(self, **changes)


@dataclass(frozen=True)
class Setting:
    """The run's settings, in the recipe's terms (``distributed.*``, ``model.activation_checkpointing*``,
    ``training.*``)."""

    ep: int
    dense_parallel: str
    ep_dispatch: str
    recompute: str
    micro_batch: int
    grad_accum: int
    cuda_graph: bool
