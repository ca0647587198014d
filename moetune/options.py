"""moetune's own keyword arguments to ``from_pretrained`` / ``from_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from moetune.fp8.settings import DEFAULT_WEIGHT_GRAD, fp8_settings


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
    """'auto' (torch's grouped GEMM on CUDA bf16, per-expert loop elsewhere), 'grouped_mm', 'triton'
    (moetune's Triton row GEMMs with the gather fused in; torch's weight-gradient GEMM), 'quack'
    (quack's CuTe-DSL grouped GEMMs, gather fused in; optional package quack-kernels, CUDA sm90+) or
    'loop'. Transformers' MoE models that take an experts implementation then run moetune's experts
    path with it; the others refuse it."""
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
    split sizes); a number sends fixed blocks of ceil(factor x rows / ep_size) rows to each rank, rows
    counted on the rank with the most tokens (eager: one host sync per MoE layer for the token counts;
    none under CUDA-graph capture or torch.compile, which need equal counts); rows beyond it are
    dropped, never when factor >= ep_size."""
    ep_overlap_chunks: int = 1
    """Expert parallelism: 1 runs each MoE layer's dispatch all-to-all, experts and combine all-to-all
    one after another; C >= 2 splits the layer's tokens into C chunks and pipelines them, so that on
    CUDA the all-to-alls of one chunk run while the experts compute another, in forward and backward
    (same results; ``moetune.distributed.PipelinedExpertParallelDispatcher``). Not combinable with
    ``ep_capacity_factor``. It pays only where the experts' compute bounds the layer: on 2 H200s at
    4096 tokens per rank it was slower (moetune/distributed/README.md)."""

    ep_dispatch: str = "alltoall"
    """Expert parallelism: 'alltoall' sends each routed copy of a token to the rank of its expert
    (``ep_capacity_factor`` / ``ep_overlap_chunks`` refine it); 'allgather' gives every rank all the
    tokens of the ep group and reduce-scatters the experts' partial outputs: fewer bytes when
    ep <= top-k, and with equal token counts on the ranks fixed shapes and no host sync, so the step
    can be captured in a CUDA graph (``moetune.distributed.AllGatherExpertParallelDispatcher``)."""
    dense_parallel: str = "fsdp"
    """Parameters other than the experts: 'fsdp' shards them with FSDP2 over all ranks; 'replicate'
    keeps full copies on every rank and averages their gradients (DDP-style), which with
    ``ep_dispatch='allgather'`` makes the expert-parallel step CUDA-graph capturable. With
    ep_size < world size the experts are replicated the same way over the ranks that hold the same
    experts (each node its own expert-parallel group, say)."""

    replicate_max_ctas: int | None = 16
    """``dense_parallel='replicate'`` on NCCL: the most CTAs (channels) the gradient all-reduces'
    communicator may use. The all-reduces are bulk work that overlaps the backward; uncapped, they take
    the NVLink bandwidth and SMs that the experts' per-layer collectives on the critical path need. On
    2 H200s (16 layers, ep=2) 8 or 16 measured 113.6-114.0 ms per step against 116.1-116.5 uncapped
    (4: 119.1, 2: 130.0; benchmarks/README.md). None: NCCL's own choice."""
    replicate_transport: str = "nccl"
    """``dense_parallel='replicate'``: how the replicated gradients are averaged. 'nccl': an all-reduce
    per gradient; 'copy_engine' (two ranks on one node, CUDA): each gradient is copied into the peer's
    symmetric-memory buffer by a copy engine and added there, with no NCCL kernel holding SMs
    (``moetune.distributed.peer_copy``; a receive buffer of the replicated gradients' size per rank).
    On 2 H200s within the spread between runs: ~1 ms faster than NCCL in one call, ~1 ms slower in the
    next (2026-11-30, commits e73f328 and 0b36cde; benchmarks/README.md)."""
    vocab_parallel: bool = False
    """``dense_parallel='replicate'``: split the input embedding and the LM head by vocabulary rows over
    all ranks (Megatron-LM's vocabulary parallelism) instead of replicating them: each rank stores,
    updates and keeps AdamW states for 1 / world of them, and the LM head's dense gradient is never
    all-reduced; the step's hidden states travel instead (``moetune.distributed.vocab_parallel``)."""

    fp8: str | None = None
    """FP8 (e4m3) training of the decoder's linear layers and experts (``moetune.fp8``): 'rowwise'
    (one scale per token / per channel) or 'blockwise' (DeepSeek-V3's 1 x 128 activation slices and
    128 x 128 weight tiles). Weights stay in their dtype (bf16 master weights, the same checkpoint);
    the router, norms, softmax, LM head and loss keep their precision. Needs a GPU with FP8 tensor
    cores (sm89+) unless ``fp8_backend='reference'``. None: no FP8."""
    fp8_backend: str = "auto"
    """With ``fp8``: 'auto' (torch's cuBLAS / CUTLASS FP8 GEMMs where torch has them, moetune's Triton
    GEMMs elsewhere), 'triton' (moetune's Triton GEMMs everywhere) or 'reference' (the plain-PyTorch
    reference, dequantised operands multiplied in fp32: any device, CPU included; for tests)."""
    fp8_weight_grad: str = DEFAULT_WEIGHT_GRAD
    """With ``fp8``: the weight gradients' GEMM in 'bf16' (the default: from the operands as the forward
    received them; faster at few tokens per expert, exact gradients, the loss of bf16 training) or 'fp8'
    (quantised along the tokens, as DeepSeek-V3 trained)."""
    cuda_graphs: bool = True
    """On CUDA, replay the decoder stack's training forward and backward from CUDA graphs (one pair per
    shape bucket; ``moetune.training.graphed_backbone``) under any training loop (Transformers'
    ``Trainer``, TRL, PEFT, your own), where that is exact; everything else (evaluation, generation,
    left-padded batches, checkpointed layers with dropout, expert parallelism) runs eagerly as before. False:
    always eager (``moetune.training.set_training_graphs(model, enabled)`` switches it later)."""

    global_aux_loss: bool = False
    """With ``ep_size`` / ``device_mesh``: the MoE load-balancing loss over all ranks' tokens, as one
    process on the whole batch computes it (the router's tokens and probabilities summed over the
    ranks, the probabilities with autograd), instead of each rank's own tokens as Transformers under
    DDP computes it. Only matters when the aux loss is on (``output_router_logits``)."""

    def __post_init__(self) -> None:
        if self.ep_size is not None and not is_positive_int(self.ep_size):
            raise ValueError(f"ep_size must be a positive int (or None), got {self.ep_size!r}")
        for name in ("balanced_gate", "reshard_after_forward", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_experts_backend_name(self.experts_backend)
        check_lora_settings(self.lora)
        for name in ("param_dtype", "reduce_dtype"):
            resolve_float_dtype(getattr(self, name), name)
        if self.ep_capacity_factor is not None and not is_positive_number(self.ep_capacity_factor):
            raise ValueError(f"ep_capacity_factor must be a positive number or None, got {self.ep_capacity_factor!r}")
        check_ep_overlap_chunks(self.ep_overlap_chunks, capacity_factor=self.ep_capacity_factor)
        check_ep_dispatch(
            self.ep_dispatch, capacity_factor=self.ep_capacity_factor, overlap_chunks=self.ep_overlap_chunks
        )
        if self.replicate_max_ctas is not None and not is_positive_int(self.replicate_max_ctas):
            raise ValueError(f"replicate_max_ctas must be a positive int (or None), got {self.replicate_max_ctas!r}")
        if self.replicate_transport not in REPLICATE_TRANSPORTS:
            raise ValueError(f"replicate_transport must be one of {REPLICATE_TRANSPORTS}, got {self.replicate_transport!r}")
        if self.dense_parallel not in DENSE_PARALLEL:
            raise ValueError(f"dense_parallel must be one of {DENSE_PARALLEL}, got {self.dense_parallel!r}")
        check_vocab_parallel_option(self.vocab_parallel, dense_parallel=self.dense_parallel)
        fp8_settings(self.fp8, self.fp8_backend, self.fp8_weight_grad)  # a ValueError / TypeError naming the field
        if not isinstance(self.global_aux_loss, bool):
            raise ValueError(f"global_aux_loss must be True or False, got {self.global_aux_loss!r}")

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> MoetuneOptions:
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})

    @property
    def fp8_settings(self):
        """``moetune.fp8.Fp8Settings`` for ``fp8`` / ``fp8_backend`` / ``fp8_weight_grad``, or None."""
        return fp8_settings(self.fp8, self.fp8_backend, self.fp8_weight_grad)

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None or (self.ep_size is not None and self.ep_size > 1)


EP_DISPATCH = ("alltoall", "allgather")
DENSE_PARALLEL = ("fsdp", "replicate")
REPLICATE_TRANSPORTS = ("nccl", "copy_engine")


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_experts_backend_name(name: Any) -> None:
    """One of ``EXPERTS_BACKENDS``, checked where the option is given, whatever the model (whether the
    model takes it and the backend's package imports are checked when the model is built)."""
    from moetune.moe.experts import EXPERTS_BACKENDS

    if name not in EXPERTS_BACKENDS:
        raise ValueError(f"experts_backend must be one of {EXPERTS_BACKENDS}, got {name!r}")


def check_lora_settings(value: Any) -> None:
    """``lora``: None or a ``moetune.lora.LoraSettings``."""
    if value is None:
        return
    from moetune.lora import LoraSettings

    if not isinstance(value, LoraSettings):
        raise TypeError(
            f"lora must be a moetune.lora.LoraSettings (e.g. LoraSettings(rank=16)) or None, got {type(value).__name__}"
        )


def resolve_float_dtype(value: Any, name: str):
    """``param_dtype`` / ``reduce_dtype`` as FSDP2's mixed-precision policy takes them: None, a floating
    torch dtype or its name ("bfloat16"), resolved to the dtype; anything else is a ValueError naming the field."""
    import torch

    resolved = getattr(torch, value, None) if isinstance(value, str) else value
    if value is not None and not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"{name} must be a floating torch dtype (or its name, e.g. 'bfloat16') or None, got {value!r}")
    return resolved


def check_ep_overlap_chunks(num_chunks: Any, *, capacity_factor: float | None) -> None:
    """``ep_overlap_chunks``: a positive int, and above 1 only with exact splits (the pipelined
    dispatcher chunks ``ExpertParallelDispatcher``'s exact all-to-alls; capacity blocks are another
    dispatcher)."""
    if not is_positive_int(num_chunks):
        raise ValueError(f"ep_overlap_chunks must be a positive int, got {num_chunks!r}")
    if num_chunks > 1 and capacity_factor is not None:
        raise ValueError(
            f"ep_overlap_chunks={num_chunks} cannot be combined with ep_capacity_factor={capacity_factor!r}: "
            "the pipelined dispatcher sends exact splits; set one of them only"
        )


def check_vocab_parallel_option(value: Any, *, dense_parallel: str) -> None:
    """``vocab_parallel``: a bool, True only with ``dense_parallel='replicate'``."""
    if not isinstance(value, bool):
        raise ValueError(f"vocab_parallel must be True or False, got {value!r}")
    if value and dense_parallel != "replicate":
        raise ValueError(
            "vocab_parallel=True splits the embedding and LM head of dense_parallel='replicate' models; with "
            f"dense_parallel={dense_parallel!r} FSDP2 shards them already"
        )


def check_ep_dispatch(name: Any, *, capacity_factor: float | None, overlap_chunks: int) -> None:
    """``ep_dispatch``: one of ``EP_DISPATCH``; the capacity and chunking options refine 'alltoall' only."""
    if name not in EP_DISPATCH:
        raise ValueError(f"ep_dispatch must be one of {EP_DISPATCH}, got {name!r}")
    if name == "allgather" and (capacity_factor is not None or overlap_chunks != 1):
        raise ValueError(
            "ep_dispatch='allgather' takes neither ep_capacity_factor nor ep_overlap_chunks > 1 "
            f"(got {capacity_factor!r}, {overlap_chunks!r}): those refine the all-to-all dispatcher"
        )
