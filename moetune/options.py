"""moetune's own keyword arguments to ``from_pretrained`` / ``from_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class MoetuneOptions:
    ep_size: int | None = None
    """Expert-parallel size: experts are split over this many ranks (needs torch.distributed).
    None or 1 with no ``device_mesh``: an unsharded model, exactly as Transformers returns."""
    device_mesh: Any = None
    """A user's ``torch.distributed.device_mesh.DeviceMesh`` (dimension names in moetune.distributed)."""
    balanced_gate: bool = False
    """Benchmark gate: assignment slot j of tokens x top_k goes to expert j mod E, weight 1/top_k."""
    experts_backend: str = "auto"
    """'auto' (grouped GEMM on CUDA bf16, per-expert loop elsewhere), 'grouped_mm' or 'loop'."""
    lora: Any = None
    """A ``moetune.lora.LoraSettings``: add LoRA adapters (base weights frozen). Under ``ep_size`` /
    ``device_mesh`` they are added after expert parallelism and before FSDP2, as sharding needs."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each layer's forward (saves memory, regathers in backward)."""
    param_dtype: Any = None
    """FSDP2 mixed precision (with ep_size / device_mesh): compute dtype of the gathered parameters,
    e.g. torch.bfloat16 over fp32 weights; None keeps the weights' dtype."""
    reduce_dtype: Any = "float32"
    """FSDP2 mixed precision: dtype of the gradient reduce-scatter; None: the compute dtype."""
    ep_capacity_factor: float | None = None
    """Expert parallelism: None sends exactly the routed rows (one host sync per MoE layer for the
    split sizes); a number sends fixed blocks of ceil(factor x rows / ep_size) rows to each rank, with
    no host sync; rows beyond it are dropped, never when factor >= ep_size."""

    def __post_init__(self) -> None:
        if self.ep_size is not None and (
            isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1
        ):
            raise ValueError(f"ep_size must be a positive int (or None), got {self.ep_size!r}")

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> MoetuneOptions:
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None or (self.ep_size is not None and self.ep_size > 1)
