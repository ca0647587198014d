"""Peak memory of one GPU, by part, from a layer-by-layer walk through one training step.

Parts (bytes on the busiest rank, rank 0: it holds the largest shard of every parameter):
- parameters, gradients, optimizer states: from ``sharding.rank_state`` (exact, FSDP2's padding
  included);
- activations: what the layers keep (``activations.py``) for ``micro_batch x seq_len`` tokens, the
  LM-head loss's kept gradients, and the working memory of the layer whose backward is running;
- communication buffers: FSDP2's gathered parameters (the running layer and the prefetched one;
  the root group, LM head and final norm, stays gathered from its forward to its backward), its
  unsharded gradients and their reduce-scatter input in ``reduce_dtype``, the expert-parallel
  dispatcher's send buffers (all-to-all) or gathered tokens and fp32 partial sums (all-gather);
- CUDA-graph pool: a graphed step keeps its activations' memory in the graph's private pool, which
  reserves more than the activations need and lends nothing to other allocations: the part beyond
  the activations (calibration ``cuda_graph_pool_factor``).

The walk: gradients appear as each layer's backward ends (they are freed by ``zero_grad``
between steps, unless gradient accumulation or a CUDA graph keeps them), while the kept
activations of the layers below are still there; the peak is the largest total along the way.
Beyond the peak the caching allocator reserves some fragmentation and the CUDA context, NCCL and
cuBLAS hold memory of their own (``reserve``): the run fits when peak + reserve <= GPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.plan.activations import head_activations, layer_activations
from moetune.plan.calibration import Calibration
from moetune.plan.inventory import EMBED_GROUP, ROOT_GROUP, Inventory
from moetune.plan.setting import PlanRequest, Setting
from moetune.plan.sharding import (
    Layout,
    fsdp_wraps_experts,
    local_block,
    rank_state,
    vocab_param_names,
)

GIB = 1024**3


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU at the step's peak (gradients and activations as they are at that moment)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    communication: float
    cuda_graph_pool: float
    reserve: float
    """CUDA context, NCCL and library workspaces, and the caching allocator's fragmentation."""
    gradients_total: float
    """All of this rank's gradients (at the end of the backward)."""
    peak_stage: str
    """Where in the step the peak falls ("forward end", "backward of layer N", "backward end")."""
    activations_max: float = 0.0
    """The most activation memory at any point of the step (at the peak there may be less)."""
    forward_saved: float = 0.0
    """What the forward leaves for the backward: every layer's kept activations and the loss's (the
    logits' chunk is gone by then); measurable as the allocated memory the forward adds."""

    @property
    def peak(self) -> float:
        """Peak allocated memory (``torch.cuda.max_memory_allocated``)."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.communication

    @property
    def total(self) -> float:
        """What the GPU must hold: the peak, the graph pool and the reserve."""
        return self.peak + self.cuda_graph_pool + self.reserve


def precision_bytes(request: PlanRequest) -> tuple[int | None, int]:
    """(bytes per parameter / gradient / optimizer element, None: each parameter's own dtype; bytes per
    activation element). ``fp32_master`` keeps the state in fp32 and computes in bf16; ``fp32`` computes
    in fp32 too. (The inventory of an fp32 run is built in fp32, so None gives 4 there.)"""
    return None, 4 if request.precision == "fp32" else 2


def layout_for(request: PlanRequest, setting: Setting) -> Layout:
    return Layout(world=request.world, ep=setting.ep, dense_parallel=setting.dense_parallel,
                  gpus_per_node=request.gpus_per_node)


def memory_breakdown(inventory: Inventory, request: PlanRequest, setting: Setting,
                     calibration: Calibration | None, *, first_step: bool = False) -> MemoryBreakdown:
    """``first_step``: the optimizer's states do not exist yet during the forward and backward (AdamW
    creates them in its first step), as in a one-step measurement."""
    layout = layout_for(request, setting)
    state_bytes, act_bytes = precision_bytes(request)
    state = rank_state(inventory, layout, 0, param_bytes=state_bytes, grad_bytes=state_bytes, optimizer_bytes=state_bytes)
    tokens = setting.micro_batch * request.seq_len
    transient_fraction = calibration["activation_transient_fraction"] if calibration else 0.35
    imbalance = calibration["ep_routing_imbalance"] if calibration and setting.ep > 1 else 1.0
    fp8_ratio = calibration["fp8_activation_ratio"] if calibration and request.fp8 else 1.0
    groups = inventory.memoized(("groups", layout, state_bytes), lambda: _group_bytes(inventory, layout, state_bytes))

    kept, working = [], []
    for layer in inventory.layers:
        rows = None if layer.moe is None else layer.moe.top_k * imbalance
        acts = layer_activations(layer, act_bytes=act_bytes, ep=setting.ep, lora_rank=inventory.lora_rank,
                                 routed_rows=rows, seq_len=request.seq_len)
        extra_kept, extra_work = _dispatch_bytes(layer, setting, act_bytes, rows)
        none = (acts.none + extra_kept) * fp8_ratio
        saved = none if setting.recompute == "none" else acts.saved(setting.recompute) * fp8_ratio
        if setting.recompute == "selective":
            saved += extra_kept
        kept.append(saved * tokens)
        # The running layer's backward: its recomputed activations (checkpointing), its gradients'
        # temporaries, the dispatcher's transient buffers.
        held = (acts.held_in_backward + extra_kept) * fp8_ratio
        recomputed = 0.0 if setting.recompute == "none" else max(0.0, held - saved)
        working.append((recomputed + transient_fraction * held + extra_work) * tokens)

    head_trainable = any(p.trainable for p in inventory.params if p.group == ROOT_GROUP and len(p.shape) == 2)
    head = head_activations(inventory, tokens=tokens, act_bytes=act_bytes, head_trainable=head_trainable)
    fsdp = setting.dense_parallel == "fsdp" and layout.world > 1
    root_gathered = groups.unsharded.get(ROOT_GROUP, 0.0) if fsdp else 0.0
    head_kept = head.per_token * tokens + head.head_grad

    persistent_grads = setting.grad_accum > 1 or setting.cuda_graph
    base = state.params_allocated + state.buffers + (0.0 if first_step else state.optimizer)
    grads_all = state.grads_allocated
    stages: list[tuple[float, float, float, float, str]] = []  # (grads, activations, communication, total, label)

    def record(grads: float, acts: float, comm: float, label: str) -> None:
        stages.append((grads, acts, comm, base + grads + acts + comm, label))

    grads_before = grads_all if persistent_grads else 0.0
    layer_groups = [f"layers.{layer.index}" for layer in inventory.layers]
    # The forward's end: every layer's kept activations, the loss's kept gradients and one chunk of logits.
    record(grads_before, sum(kept) + head_kept + head.logits_chunk, root_gathered + _gathered(groups, layer_groups, -1, fsdp),
           "forward end")
    grads_done = grads_before or groups.grads.get(ROOT_GROUP, 0.0)
    for k in range(len(inventory.layers) - 1, -1, -1):
        comm = root_gathered + _gathered(groups, layer_groups, k, fsdp) + _gathered(groups, layer_groups, k - 1, fsdp)
        if fsdp:  # the layer's unsharded gradients, in the parameters' dtype and in the reduce dtype
            comm += groups.unsharded_grads.get(layer_groups[k], 0.0) * (1 + 4 / groups.state_element)
        acts = sum(kept[:k + 1]) + working[k] + (head.per_token * tokens if k == len(inventory.layers) - 1 else 0.0)
        record(grads_done, acts, comm, f"backward of layer {k}")
        if not persistent_grads:
            grads_done += groups.grads.get(layer_groups[k], 0.0) + groups.grads.get(layer_groups[k] + ".experts", 0.0)
    record(grads_all, 0.0, root_gathered if fsdp else 0.0, "backward end")
    if first_step:
        base = state.params_allocated + state.buffers + state.optimizer
        record(grads_all, 0.0, 0.0, "optimizer step")
    grads, acts, comm, total, label = max(stages, key=lambda s: s[3])

    peak = total
    # A graphed step's activations live in the graph's private pool, which reserves more than they need
    # and lends nothing to other allocations.
    pool = 0.0
    if setting.cuda_graph and calibration is not None:
        pool = (calibration["cuda_graph_pool_factor"] - 1.0) * max(stage[1] for stage in stages)
    reserve = 0.0
    if calibration is not None:
        reserve = calibration["cuda_context_gib"] * GIB + calibration["allocator_fragmentation"] * peak
    optimizer = state.optimizer if (not first_step or label == "optimizer step") else 0.0
    return MemoryBreakdown(parameters=state.params_allocated + state.buffers, gradients=grads, optimizer=optimizer,
                           activations=acts, communication=comm, cuda_graph_pool=pool, reserve=reserve,
                           gradients_total=grads_all, peak_stage=label, activations_max=max(s[1] for s in stages),
                           forward_saved=sum(kept) + head_kept)


def _dispatch_bytes(layer, setting: Setting, act_bytes: int, rows: float | None) -> tuple[float, float]:
    """(kept, transient) bytes per token of the expert-parallel dispatcher beyond the experts' rows."""
    if layer.moe is None or setting.ep == 1:
        return 0.0, 0.0
    width = layer.moe.expert_in
    if setting.ep_dispatch == "allgather":
        # Every rank holds the ep group's tokens (kept for the experts' weight gradient) and reduce-
        # scatters fp32 partial sums of all of them.
        return setting.ep * width * act_bytes, setting.ep * width * 4
    return 0.0, (rows or layer.moe.top_k) * width * act_bytes  # the all-to-all's send buffer


@dataclass(frozen=True)
class _Groups:
    grads: dict[str, float]
    """FSDP2 group -> this rank's gradient bytes (allocated)."""
    unsharded: dict[str, float]
    """FSDP2 group -> bytes of its gathered parameters."""
    unsharded_grads: dict[str, float]
    state_element: int


def _group_bytes(inventory: Inventory, layout: Layout, state_bytes: int | None) -> _Groups:
    vocab = vocab_param_names(inventory) if layout.vocab_parallel else frozenset()
    grads: dict[str, float] = {}
    unsharded: dict[str, float] = {}
    unsharded_grads: dict[str, float] = {}
    element = state_bytes or 2
    for param in inventory.params:
        size = state_bytes or param.dtype_bytes
        block = local_block(param, layout, 0, vocab_params=vocab)
        if param.trainable:
            grads[param.group] = grads.get(param.group, 0.0) + block.allocated * size
        gathered_ranks = layout.replicas if param.expert else layout.world
        if param.expert and not fsdp_wraps_experts(layout):
            continue  # not FSDP2-managed: nothing is gathered
        full = block.allocated * gathered_ranks * size
        unsharded[param.group] = unsharded.get(param.group, 0.0) + full
        if param.trainable:
            unsharded_grads[param.group] = unsharded_grads.get(param.group, 0.0) + full
    # A layer's experts are gathered with their layer: count them in the layer's group.
    for name in list(unsharded):
        if name.endswith(".experts"):
            layer = name[: -len(".experts")]
            unsharded[layer] = unsharded.get(layer, 0.0) + unsharded.pop(name)
            unsharded_grads[layer] = unsharded_grads.get(layer, 0.0) + unsharded_grads.pop(name, 0.0)
    unsharded.pop(EMBED_GROUP, None)  # gathered only around the embedding lookup
    return _Groups(grads=grads, unsharded=unsharded, unsharded_grads=unsharded_grads, state_element=element)


def _gathered(groups: _Groups, layer_groups: list[str], k: int, fsdp: bool) -> float:
    if not fsdp or k < 0 or k >= len(layer_groups):
        return 0.0
    return groups.unsharded.get(layer_groups[k], 0.0)
