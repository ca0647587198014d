"""``parallelize(model, mesh, config)``: expert parallelism, activation checkpointing, (compile,) then
FSDP2, applied in that order to a moetune model built on the meta device (TorchTitan's
``parallelize_llama``). ``parallelize_for_options`` is what ``from_pretrained`` / ``from_config``
call: checks, mesh, ``parallelize``, allocation on this rank's device, optional init.

Placements (mesh dims in moetune/distributed/mesh.py):
- expert weights [E, X, Y]: ``Shard(0)`` over ``ep`` (rank holds E/ep experts), then FSDP2 over
  ``dp_shard_mod_ep`` (``Shard(0)`` of the local experts, or ``Shard(1)`` when there are fewer local
  experts than ranks to shard them over);
- every other parameter: FSDP2 ``Shard(0)`` over ``dp_shard`` (all ranks).

Gradients are averaged over all ``world`` ranks for every parameter (as DDP / FSDP do). The experts'
FSDP2 group has only world / ep ranks but their gradients already sum the tokens of ep ranks; the
dispatcher scales the gradient entering the experts by 1 / ep to compensate (see dispatcher.py).
"""

from __future__ import annotations

import os
from typing import Any

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moetune.distributed.allgather_dispatcher import AllGatherExpertParallelDispatcher
from moetune.distributed.dispatcher import CapacityExpertParallelDispatcher, ExpertParallelDispatcher
from moetune.distributed.inference import KEEP_GATHERED_ATTR, RESHARD_ATTR, run_inference_mode_as_no_grad
from moetune.distributed.mesh import (
    ParallelMesh,
    build_mesh,
    is_sharded_by_moetune,
    rank_device,
    require_process_group,
)
from moetune.distributed.pipelined_dispatcher import PipelinedExpertParallelDispatcher
from moetune.distributed.vocab_parallel import shard_vocabulary
from moetune.distributed.sharded_init import sharded_init_functions
from moetune.distributed.replicate import (
    ReplicatedGradientSync,
    broadcast_parameters,
    gather_embedding_gradients,
    no_gradient_sync,
)
from moetune.moe import GroupedExperts, MoEBlock, TokenDispatcher
from moetune.options import (
    DENSE_PARALLEL,
    check_ep_dispatch,
    check_ep_overlap_chunks,
    check_vocab_parallel_option,
    resolve_float_dtype,
)
from moetune.utils.materialize import materialize


@dataclass
class ParallelConfig:
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after each layer's forward (regathered in backward)."""
    param_dtype: torch.dtype | None = None
    """FSDP2 compute dtype of gathered parameters; None keeps the parameters' dtype (bf16 when loaded
    with ``dtype=torch.bfloat16``, the published setting). torch.bfloat16 with fp32 parameters gives
    bf16 compute over fp32 master weights."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Dtype of the gradient reduce-scatter (fp32: exact sums of bf16 gradients); None: the compute dtype."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (non-reentrant; routing is recomputed identically)."""
    lora: Any = None
    """A ``moetune.lora.LoraSettings`` applied after expert parallelism and before FSDP2 (FSDP2 only
    manages the parameters that exist when it shards), or None."""
    ep_capacity_factor: float | None = None
    """None: exact all-to-all splits (one host sync per MoE layer). A number: fixed per-peer buffers of
    ceil(factor * routed rows / ep) rows (of the rank with the most tokens; no host sync under capture or
    compile); >= ep never drops a token (see dispatcher.py)."""
    ep_overlap_chunks: int = 1
    """1: each MoE layer's all-to-alls and experts run one after another. C >= 2: the layer's tokens go
    in C chunks whose all-to-alls overlap the experts of other chunks on CUDA (pipelined_dispatcher.py).
    Only with exact splits (``ep_capacity_factor=None``)."""
    ep_dispatch: str = "alltoall"
    """'alltoall' (the dispatchers above) or 'allgather' (allgather_dispatcher.py: fixed shapes, no host sync)."""
    dense_parallel: str = "fsdp"
    """'fsdp': FSDP2 over all ranks for every non-expert parameter (and the experts over the ranks that
    hold the same experts); 'replicate': full copies on every rank (and of each rank's experts on the
    ranks that hold the same experts), gradients averaged in the backward (replicate.py)."""
    replicate_max_ctas: int | None = 16
    """'replicate' on NCCL: the most CTAs of the gradient all-reduces' communicator (None: NCCL's choice)."""
    replicate_transport: str = "nccl"
    """'replicate': 'nccl' all-reduces, or 'copy_engine' (two ranks: symmetric memory, peer_copy.py)."""
    vocab_parallel: bool = False
    """'replicate': split the input embedding and the LM head by vocabulary rows over all ranks
    instead of replicating them (vocab_parallel.py)."""


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of every ``layers`` ModuleList (Transformers' naming)."""
    return [
        layer
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
        for layer in module
    ]


def num_experts_of(model: nn.Module) -> int:
    counts = {block.num_experts for block in moe_blocks(model)}
    if len(counts) > 1:
        raise ValueError(f"MoE layers with different numbers of experts {sorted(counts)} are not supported")
    return counts.pop() if counts else 0


def check_unsharded(model: nn.Module) -> None:
    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model is already sharded (FSDP2 / expert parallel); it cannot be parallelized again")
    if any(type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") for m in model.modules()):
        raise ValueError("the model is wrapped in DDP / FSDP; moetune shards it itself from ep_size / device_mesh")


def parallelize(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> nn.Module:
    """EP -> activation checkpointing -> (compile) -> FSDP2, in place; parameters stay on the meta device."""
    check_unsharded(model)
    check_dense_parallel(config.dense_parallel, mesh)
    check_vocab_parallel_option(config.vocab_parallel, dense_parallel=config.dense_parallel)
    if mesh.ep_size > 1:
        apply_expert_parallel(
            model,
            mesh,
            capacity_factor=config.ep_capacity_factor,
            overlap_chunks=config.ep_overlap_chunks,
            dispatch=config.ep_dispatch,
        )
    if config.vocab_parallel:
        shard_vocabulary(model, mesh.world)
    if config.lora is not None:
        from moetune.lora import apply_lora

        apply_lora(model, config.lora)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    # torch.compile of each decoder layer would belong here, between AC and FSDP2. Not offered as an
    # option (no measured gain over moetune's fused kernels yet); a user's layer.compile() works: the
    # experts run eagerly inside the compiled layer (GroupedExperts.forward), as dynamo does not trace
    # their DTensor unwrap.
    if config.dense_parallel == "fsdp":
        apply_fsdp(model, mesh, config)
    _refuse_ddp(model)
    # 'replicate': nothing to shard; the gradient averaging needs the allocated parameters
    # (replicate_dense_parameters, after allocation).
    return model


def check_dense_parallel(name: str, mesh: ParallelMesh) -> None:
    if name not in DENSE_PARALLEL:
        raise ValueError(f"dense_parallel must be one of {DENSE_PARALLEL}, got {name!r}")


def replicate_dense_parameters(
    model: nn.Module, mesh: ParallelMesh, *, max_ctas: int | None = None, transport: str = "nccl"
) -> list[ReplicatedGradientSync]:
    """For an allocated model parallelized with ``dense_parallel='replicate'``: equal copies of the
    non-expert parameters on every rank, and their gradients averaged over all ranks in every
    backward. With ep < world the experts are replicated too, over the ``dp_shard_mod_ep`` ranks that
    hold the same experts, and averaged there (with the dispatcher's 1 / ep scaling, the average over
    all ranks, as for every other parameter)."""
    dense = [p for p in model.parameters() if not isinstance(p, DTensor)]
    broadcast_parameters(dense, group=mesh.world.get_group())
    # The gradients get a communicator of their own, with few CTAs: the all-reduces are bulk work
    # that overlaps the backward, and uncapped they slowed the experts' per-layer collectives on the
    # critical path (sharing NVLink and SMs; on 2 H200s a 16-CTA cap took a 16-layer step from
    # ~116.3 to ~113.7 ms). When ep == world, DeviceMesh hands the ep dim the default group, which is
    # also the flattened world's; a separate communicator alone measured no gain.
    group = dist.new_group(ranks=list(range(mesh.world_size)), group_desc="moetune_replicated_grads",
                           pg_options=_nccl_options(max_ctas))  # fmt: skip
    syncs = [_dense_gradient_sync(model, group, transport=transport)]
    if mesh.world_size > mesh.ep_size:
        # The experts' shards only: a vocab_parallel embedding / LM head is split over all ranks, not replicated.
        experts = [p for block in moe_blocks(model) for p in block.experts.parameters() if isinstance(p, DTensor)]
        replicas = mesh.dp_shard_mod_ep.get_group()
        broadcast_parameters(experts, group=replicas)
        syncs.append(ReplicatedGradientSync(experts, group=replicas))
    return syncs


def _nccl_options(max_ctas: int | None):
    """Options of a new NCCL process group with at most ``max_ctas`` CTAs (None on other backends)."""
    if max_ctas is None or dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    options.config.min_ctas = 1
    return options


def _dense_gradient_sync(model: nn.Module, group: dist.ProcessGroup, *, transport: str = "nccl") -> ReplicatedGradientSync:
    """The all-reduce of every non-expert gradient but the input embedding's, which is built averaged
    from the gathered tokens where it can be (``gather_embedding_gradients``)."""
    dense = [p for p in model.parameters() if not isinstance(p, DTensor)]
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding.weight
    vocab_parallel = isinstance(embedding.weight, DTensor)  # split over the ranks, not replicated (vocab_parallel.py)
    if not tied and not vocab_parallel and gather_embedding_gradients(embedding, group=group):  # averaged in its own backward
        dense = [p for p in dense if p is not embedding.weight]
    return ReplicatedGradientSync(dense, group=group, transport=transport)


def resize_token_embeddings_replicated(model: nn.Module, resize, *args, **kwargs):
    """``model.resize_token_embeddings`` of a ``dense_parallel='replicate'`` model: Transformers' resize,
    then the new rows made equal on every rank (they are drawn at random on each) and the gradients of
    the new LM head (a new module) averaged like the old one's."""
    result = resize(*args, **kwargs)
    syncs = model.replicated_gradient_syncs
    group = syncs[0].group
    resized = [module.weight for module in (model.get_input_embeddings(), model.get_output_embeddings()) if module is not None]
    broadcast_parameters(list({id(p): p for p in resized}.values()), group=group)
    syncs[0].remove()
    syncs[0] = _dense_gradient_sync(model, group, transport=syncs[0].transport)  # the same list: model.no_sync holds it
    return result


def _refuse_resize(*_args, **_kwargs):
    raise ValueError(
        "resize_token_embeddings on an FSDP2-sharded model: resize the vocabulary before sharding (load without "
        "ep_size / device_mesh, resize, save, load again with them) or use dense_parallel='replicate'"
    )


def _refuse_resize_vocab_parallel(*_args, **_kwargs):
    raise ValueError(
        "resize_token_embeddings on a vocab_parallel model (embedding and LM head split over the ranks): resize the "
        "vocabulary before sharding (load without ep_size / device_mesh, resize, save, load again) or load with "
        "vocab_parallel=False"
    )


def _refuse_ddp(model: nn.Module) -> None:
    """Make ``DistributedDataParallel(model)`` fail with a clear message instead of a DTensor error deep
    inside its constructor (which reads this attribute with ``hasattr`` first): a property on the
    model's class that raises for the instances moetune sharded (``parallel_mesh``) and is absent
    (AttributeError) for the others, so unsharded models of the same class still wrap."""

    def refuse(self):
        if not is_sharded_by_moetune(self):
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        raise ValueError(
            "this model is already sharded by moetune (expert parallelism and FSDP2 or replicated parameters, from "
            "ep_size / device_mesh) and synchronises its own gradients: train it as is, without "
            "DistributedDataParallel / FSDP (with Transformers' Trainer, use moetune.Trainer)"
        )

    cls = type(model)
    if not isinstance(cls.__dict__.get("_ddp_params_and_buffers_to_ignore"), property):
        cls._ddp_params_and_buffers_to_ignore = property(refuse)


def apply_expert_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    capacity_factor: float | None = None,
    overlap_chunks: int = 1,
    dispatch: str = "alltoall",
) -> None:
    """Experts' 3-D weights become DTensors ``Shard(0)`` over ``ep``; each MoE block gets the expert-parallel dispatcher."""
    ep_mesh, ep_size = mesh.ep, mesh.ep_size
    dispatcher = expert_parallel_dispatcher(
        ep_mesh.get_group(),
        ep_size=ep_size,
        capacity_factor=capacity_factor,
        overlap_chunks=overlap_chunks,
        dispatch=dispatch,
    )
    for block in moe_blocks(model):
        experts = block.experts
        if not isinstance(experts, GroupedExperts):
            raise ValueError(f"expert parallelism needs moetune's GroupedExperts, got {type(experts).__name__}")
        for name, param in list(experts.named_parameters(recurse=False)):
            assert param.shape[0] == block.num_experts, (name, tuple(param.shape))
            local = torch.empty(
                (param.shape[0] // ep_size, *param.shape[1:]), dtype=param.dtype, device=param.device
            )
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        block.dispatcher = dispatcher


def expert_parallel_dispatcher(
    group, *, ep_size: int, capacity_factor: float | None, overlap_chunks: int, dispatch: str = "alltoall"
) -> TokenDispatcher:
    check_ep_overlap_chunks(overlap_chunks, capacity_factor=capacity_factor)
    check_ep_dispatch(dispatch, capacity_factor=capacity_factor, overlap_chunks=overlap_chunks)
    if dispatch == "allgather":
        return AllGatherExpertParallelDispatcher(group=group, ep_size=ep_size)
    if capacity_factor is not None:
        return CapacityExpertParallelDispatcher(group=group, ep_size=ep_size, capacity_factor=capacity_factor)
    if overlap_chunks > 1:
        return PipelinedExpertParallelDispatcher(group=group, ep_size=ep_size, num_chunks=overlap_chunks)
    return ExpertParallelDispatcher(group=group, ep_size=ep_size)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Transformers' per-layer checkpointing (parameter names unchanged), non-reentrant so it composes
    with FSDP2's hooks and the dispatcher's collectives, which are re-run in the same order on every rank."""
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    if not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        raise ValueError("activation checkpointing needs Transformers' GradientCheckpointingLayer decoder layers")
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> None:
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    common = {"mp_policy": mp_policy, "reshard_after_forward": config.reshard_after_forward}
    experts_mesh = mesh.dp_shard_mod_ep
    ignored: set[nn.Parameter] = set()
    for block in moe_blocks(model):
        if experts_mesh.size() == 1 and _keeps_dtype(block.experts, config.param_dtype):
            # ep == world: each rank owns its experts outright, so FSDP2 over a one-rank group would
            # only copy them into and out of its buffers (about 4x the experts' bytes per step).
            ignored.update(block.experts.parameters())
            continue
        num_local = block.num_experts // mesh.ep_size
        # Shard(1) when Shard(0) would leave ranks without an expert (TorchTitan's rule).
        dim = 0 if num_local % experts_mesh.size() == 0 else 1
        fully_shard(block.experts, mesh=experts_mesh, shard_placement_fn=lambda _p, d=dim: Shard(d), **common)
        setattr(block.experts, RESHARD_ATTR, config.reshard_after_forward)
    if ignored:
        common["ignored_params"] = ignored
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh.world, **common)
        setattr(layer, RESHARD_ATTR, config.reshard_after_forward)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    # The LM head stays in the root group: the fused loss reads its weight without calling the module.
    if embeddings is not None and not _tied(model, embeddings):
        fully_shard(embeddings, mesh=mesh.world, **common)
        setattr(embeddings, RESHARD_ATTR, config.reshard_after_forward)
    # The root group (LM head, final norm) is used last in forward and first in backward: keeping it
    # gathered between the two saves one all-gather of the head per step (TorchTitan does the same).
    fully_shard(model, mesh=mesh.world, **{**common, "reshard_after_forward": False})
    setattr(model, RESHARD_ATTR, False)
    # Without a backward to reshard it, the root group would stay gathered after an inference forward
    # (evaluation, generation, expert counts): an optimizer built then would hold FSDP2's temporary
    # unsharded tensors instead of the parameters, and every update of the LM head would be lost.
    model.register_forward_hook(_reshard_after_inference)
    run_inference_mode_as_no_grad(model)
    if mesh.device_type == "cpu":
        # gloo has neither ReduceOp.AVG nor PREMUL_SUM: sum in the collective, divide locally.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _reshard_after_inference(module: FSDPModule, _inputs, _output) -> None:
    if not torch.is_grad_enabled() and not getattr(module, KEEP_GATHERED_ATTR, False):
        module.reshard()


def _keeps_dtype(module: nn.Module, param_dtype: torch.dtype | None) -> bool:
    return param_dtype is None or all(p.dtype == param_dtype for p in module.parameters())


def _tied(model: nn.Module, embeddings: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and head.weight is embeddings.weight


def parallelize_for_options(model: nn.Module, options, *, init_weights: bool) -> nn.Module:
    """From ``MoetuneOptions`` (``ep_size`` / ``device_mesh``): validate, shard, allocate on this rank's
    device, rebuild RoPE buffers, and initialise the weights if ``init_weights`` (``from_config``)."""
    require_process_group()
    device = rank_device()
    check_unsharded(model)
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("parallelize_for_options expects a model built on the meta device")
    config = ParallelConfig(
        reshard_after_forward=options.reshard_after_forward,
        param_dtype=resolve_float_dtype(getattr(options, "param_dtype", None), "param_dtype"),
        reduce_dtype=resolve_float_dtype(getattr(options, "reduce_dtype", torch.float32), "reduce_dtype"),
        activation_checkpointing=bool(getattr(options, "activation_checkpointing", False)),
        ep_capacity_factor=_capacity_factor(getattr(options, "ep_capacity_factor", None)),
        ep_overlap_chunks=getattr(options, "ep_overlap_chunks", 1),
        ep_dispatch=getattr(options, "ep_dispatch", "alltoall"),
        dense_parallel=getattr(options, "dense_parallel", "fsdp"),
        replicate_max_ctas=getattr(options, "replicate_max_ctas", 16),
        replicate_transport=getattr(options, "replicate_transport", "nccl"),
        vocab_parallel=getattr(options, "vocab_parallel", False),
        lora=getattr(options, "lora", None),
    )
    # Symmetric memory joins the GPUs of one node: two nodes of one process each are refused too.
    on_this_node = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())
    if config.replicate_transport == "copy_engine" and (
        config.dense_parallel != "replicate" or device.type != "cuda" or dist.get_world_size() != 2 or on_this_node != 2
    ):
        raise ValueError(
            "replicate_transport='copy_engine' averages replicated gradients between two CUDA ranks: it needs "
            f"dense_parallel='replicate', CUDA and 2 processes on one node (got dense_parallel={config.dense_parallel!r}, "
            f"device {device.type}, {dist.get_world_size()} processes, {on_this_node} on this node)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the mesh: NCCL communicators bind to the current device
    mesh = build_mesh(
        ep_size=options.ep_size, device_mesh=options.device_mesh, num_experts=num_experts_of(model), device=device
    )
    parallelize(model, mesh, config)
    allocate(model, device, init_weights=init_weights)
    if config.lora is not None:  # to_empty left the adapters uninitialised
        from moetune.lora import reset_lora_parameters

        reset_lora_parameters(model)
    if config.dense_parallel == "replicate":
        model.replicated_gradient_syncs = replicate_dense_parameters(  # kept alive with the model
            model, mesh, max_ctas=config.replicate_max_ctas, transport=config.replicate_transport
        )
        # DDP's name, which accelerate (Transformers' Trainer) and the recipe call for all but the last
        # micro-batch of a step.
        model.no_sync = partial(no_gradient_sync, model.replicated_gradient_syncs)
        resize = _refuse_resize_vocab_parallel if config.vocab_parallel else partial(
            resize_token_embeddings_replicated, model, model.resize_token_embeddings
        )  # fmt: skip
        model.resize_token_embeddings = resize
    elif config.dense_parallel == "fsdp":
        model.resize_token_embeddings = _refuse_resize
    model.parallel_mesh = mesh
    if getattr(options, "global_aux_loss", False):
        model.aux_loss_group = mesh.world.get_group()  # read by the causal-LM forward's aux loss
    return model


def _capacity_factor(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"ep_capacity_factor must be a positive number or None, got {value!r}")
    return float(value)


def allocate(model: nn.Module, device: torch.device, *, init_weights: bool) -> None:
    materialize(model, device)
    if init_weights:
        with torch.no_grad(), sharded_init_functions():
            model.init_weights()
