"""Load-balanced expert placement: relabel each MoE layer's experts so that the contiguous blocks
expert parallelism gives each rank carry equal routed loads (DeepSeek's EPLB, without replicas).

Why: expert parallelism gives rank r the experts [r*L, (r+1)*L) of a layer. Routers are uneven (a
pretrained one strongly, a random-init one by a few percent), and every MoE layer ends in a
collective that waits for the rank with the most routed rows. Measured on row B (2 H200s, ep=2,
benchmarks/README.md): the ranks waited 3-5 ms per step for each other in the per-layer
collectives; on CPU the busier of two ranks got 1.9-8.1% more rows per layer, a balanced placement
0-0.05%.

How: a relabelling permutes, with the same permutation, the router's per-expert rows (its weight,
bias and score-correction bias) and every per-expert tensor of the experts (dim 0). The model
computes exactly the same function (each token reaches the same expert weights, with the same
combine weights; only the labels change), and saved checkpoints stay correct: a saved checkpoint is
the same model with its experts listed in the new order (plain Transformers loads it). The router
logits that the aux loss and ``output_router_logits`` see are put back in the Hub's order
(``capture_router_logits``): Transformers' aux loss pools each expert index over all layers, so
per-layer relabels would otherwise change its value. ``restore_expert_order`` undoes the relabelling (e.g. before exporting, so
that expert indices keep their Hub meaning).

Relabel before building the optimizer (its states are per position). Not supported: routers that
limit tokens to groups of consecutive experts (DeepSeek-V3's ``n_group`` > 1: a relabelling would
change the groups) and LoRA adapters on the experts (an exported adapter must match the original
base model's expert order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from moetune.moe.experts import GroupedExperts
from moetune.moe.layer import MoEBlock


def balanced_expert_order(loads_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The slot order that balances ``loads_E`` (routed rows per expert) over ``num_ranks`` contiguous
    blocks of equal size: experts sorted by load, each to the block with the fewest rows that still has
    room (longest-processing-time first, equal expert counts); each block lists its experts in their
    current order. Returns ``order`` [E] (int64): new slot s holds the expert now at slot ``order[s]``."""
    loads = [int(x) for x in loads_E.tolist()]
    num_experts = len(loads)
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"balanced_expert_order: {num_experts} experts do not split evenly over {num_ranks} ranks")
    per_rank = num_experts // num_ranks
    rows, members = [0] * num_ranks, [[] for _ in range(num_ranks)]
    for expert in sorted(range(num_experts), key=lambda e: (-loads[e], e)):
        rank = min((r for r in range(num_ranks) if len(members[r]) < per_rank), key=lambda r: (rows[r], r))
        members[rank].append(expert)
        rows[rank] += loads[expert]
    return torch.tensor([e for block in members for e in sorted(block)], dtype=torch.int64)


@torch.no_grad()
def expert_loads(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, all_ranks: bool = True
) -> dict[str, torch.Tensor]:
    """Routed rows per expert slot of every MoE layer ({block name: [E] int64 on CPU}) over forwards of
    ``model`` on ``batches`` (keyword inputs; every position counts, padding included: pass unpadded or
    packed batches). ``all_ranks``: summed over the ranks of the default process group when one is
    initialised (each rank passes its own batches and gets the same counts)."""
    blocks = _moe_blocks(model)
    device = next(model.parameters()).device
    # Counted where the routing is (no host sync per layer and forward); to the CPU once at the end.
    counts = {name: torch.zeros(block.num_experts, dtype=torch.int64, device=device) for name, block in blocks.items()}

    def counter(name: str, num_experts: int):
        def hook(_router, _inputs, routing):
            counts[name] += torch.bincount(routing.experts_TK.reshape(-1), minlength=num_experts).to(device)

        return hook

    handles = [block._modules[block._router_name].register_forward_hook(counter(name, block.num_experts))
               for name, block in blocks.items()]  # fmt: skip
    was_training = model.training
    try:
        model.eval()
        for batch in batches:
            model(**batch)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    # (moetune's FSDP2 wrapping reshards its root group after these no-grad forwards: an optimizer built
    # next holds the sharded parameters; see parallelize.apply_fsdp.)
    stacked = torch.stack(list(counts.values())) if counts else torch.zeros(0, dtype=torch.int64, device=device)
    if all_ranks and dist.is_available() and dist.is_initialized():
        stacked = stacked.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(stacked)
    return dict(zip(counts, stacked.cpu()))


@torch.no_grad()
def rebalance_experts(model: nn.Module, loads: Mapping[str, torch.Tensor], *, num_ranks: int) -> dict[str, torch.Tensor]:
    """Relabel the experts of every MoE layer named in ``loads`` (routed rows per current slot, e.g.
    from ``expert_loads``) so that ``num_ranks`` contiguous blocks (the expert-parallel shards) carry
    balanced loads; a layer whose busiest block the rule would not lighten keeps its placement. Every
    rank must pass the same loads. Returns each layer's order: slot s now holds the Hub-checkpoint
    expert ``order[s]``."""
    blocks = _moe_blocks(model)
    unknown = sorted(set(loads) - set(blocks))
    if unknown:
        raise ValueError(f"rebalance_experts: no MoE layer named {unknown[:3]} (layers: {sorted(blocks)[:3]} ...)")
    orders = {}
    for name, loads_E in loads.items():
        block = blocks[name]
        if loads_E.numel() != block.num_experts:
            raise ValueError(f"rebalance_experts: loads[{name!r}] has {loads_E.numel()} entries for {block.num_experts} experts")
        order = balanced_expert_order(loads_E, num_ranks)
        # The greedy rule is not optimal: keep the current placement unless the new one is better on these loads.
        if rows_per_rank(loads_E[order], num_ranks).max() < rows_per_rank(loads_E, num_ranks).max():
            _permute_block(name, block, order)
        orders[name] = expert_order(block)
    return orders


@torch.no_grad()
def restore_expert_order(model: nn.Module) -> None:
    """Undo every relabelling: each expert back at its Hub-checkpoint index."""
    for name, block in _moe_blocks(model).items():
        if _expert_slots(block) is not None:
            _permute_block(name, block, torch.argsort(expert_order(block)))


def expert_order(block: MoEBlock) -> torch.Tensor:
    """The Hub-checkpoint index of the expert in each slot of ``block`` (the identity when never relabelled), on CPU."""
    slots = _expert_slots(block)
    return torch.arange(block.num_experts) if slots is None else torch.argsort(slots.cpu())


def rows_per_rank(loads_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Routed rows of each of ``num_ranks`` contiguous expert blocks (the expert-parallel shards)."""
    return loads_E.view(num_ranks, -1).sum(1)


def _expert_slots(block: MoEBlock) -> torch.Tensor | None:
    """The slot of each Hub-checkpoint expert (None when the layer is in the Hub's order)."""
    return getattr(block._modules[block._router_name], "expert_slots", None)


def _moe_blocks(model: nn.Module) -> dict[str, MoEBlock]:
    return {name: module for name, module in model.named_modules() if isinstance(module, MoEBlock)}


def _permute_block(name: str, block: MoEBlock, order: torch.Tensor) -> None:
    router = block._modules[block._router_name]
    if getattr(router, "num_groups", 1) > 1:
        raise ValueError(
            f"rebalance_experts: {name}'s router limits tokens to {router.num_groups} groups of consecutive experts; "
            "relabelling would change the groups"
        )
    if not isinstance(block.experts, GroupedExperts):
        raise ValueError(f"rebalance_experts: {name}.experts is {type(block.experts).__name__}, not moetune's GroupedExperts")
    own = {id(p) for p in block.experts._parameters.values() if p is not None}
    extra = [n for n, p in block.experts.named_parameters() if id(p) not in own]
    if extra:
        raise ValueError(f"rebalance_experts: {name}.experts has adapter parameters ({extra[:2]}); relabel before adding LoRA")
    new_order = expert_order(block)[order]
    buffers = [b for n, b in router._buffers.items() if n != "expert_slots"]
    for tensor in [*block.experts._parameters.values(), *router._parameters.values(), *buffers]:
        if tensor is not None and tensor.shape[0] == block.num_experts:
            _permute_rows(tensor, order)
    if torch.equal(new_order, torch.arange(block.num_experts)):
        router._buffers.pop("expert_slots", None)  # back in the Hub's order: nothing to reorder
        return
    # On the router, next to the logits it labels: capture_router_logits gathers their columns back to
    # the Hub's order with it (one index_select). Not persistent: state dicts keep Transformers' keys.
    router.register_buffer("expert_slots", torch.argsort(new_order).to(router.weight.device), persistent=False)


def _permute_rows(tensor: torch.Tensor, order: torch.Tensor) -> None:
    """``tensor[:] = tensor[order]`` along dim 0, in place; for a DTensor through its full value (every
    rank computes the same full tensor, then keeps its own shard)."""
    if isinstance(tensor, DTensor):
        full = tensor.full_tensor().index_select(0, order.to(tensor.device))
        replicated = DTensor.from_local(full, tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim, run_check=False)
        tensor.to_local().copy_(replicated.redistribute(tensor.device_mesh, tensor.placements).to_local())
    else:
        tensor.copy_(tensor.index_select(0, order.to(tensor.device)))
