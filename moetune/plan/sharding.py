"""Which block of every parameter each rank holds, computed from moetune's sharding rules alone
(no process group): the planner's own account of ``moetune.distributed.parallelize``, which the
simulation tests check against the real ``parallelize`` under torch's fake process group.

The mesh (moetune/distributed/mesh.py): ``world`` ranks as (world / ep, ep), ``ep`` innermost, so
global rank r sits at (i, j) = (r // ep, r % ep).

- Expert weights [E, X, Y] (and their LoRA adapters): rank (i, j) holds experts
  [j E/ep, (j+1) E/ep); with ``dense_parallel="fsdp"`` FSDP2 then splits that block over the
  world / ep ranks holding the same experts, on dim 0 when E/ep divides evenly among them, else on
  dim 1 (torch.chunk's split: ceil-sized chunks, the last ones shorter or empty); with ep == world
  (nothing to split) the block stays whole. With ``"replicate"`` the block is replicated.
- Every other parameter: ``Shard(0)`` over all ranks (FSDP2, torch.chunk's split), or whole on every
  rank with ``"replicate"`` (except the embedding and LM head under ``vocab_parallel``: Shard(0)).

FSDP2 allocates each shard padded to the chunk size (every rank the same bytes); the DTensor's
local tensor is the unpadded block. Both are reported.

Loading: each rank reads from a checkpoint exactly the parts of its tensors that fall in its block
(``moetune.checkpoint.loader``), so the blocks of distinct ranks tiling each parameter exactly once
is the same as every checkpoint tensor being read exactly once (per set of replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from moetune.plan.inventory import Inventory, ParamInfo

DENSE_PARALLEL = ("fsdp", "replicate")


@dataclass(frozen=True)
class Layout:
    """How a run's ranks are arranged and what is sharded over them."""

    world: int
    ep: int = 1
    dense_parallel: str = "fsdp"
    vocab_parallel: bool = False
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.world < 1 or self.ep < 1 or self.world % self.ep:
            raise ValueError(f"ep_size={self.ep} must divide the world size {self.world}")
        if self.dense_parallel not in DENSE_PARALLEL:
            raise ValueError(f"dense_parallel must be one of {DENSE_PARALLEL}, got {self.dense_parallel!r}")
        if self.vocab_parallel and self.dense_parallel != "replicate":
            raise ValueError("vocab_parallel splits the embedding and LM head of dense_parallel='replicate' runs")

    @property
    def replicas(self) -> int:
        """Ranks holding the same experts (``dp_shard_mod_ep``)."""
        return self.world // self.ep

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    def coordinate(self, rank: int) -> tuple[int, int]:
        return rank // self.ep, rank % self.ep


@dataclass(frozen=True)
class Block:
    """The part of a parameter one rank holds."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    allocated: int
    """Elements the rank allocates for it (FSDP2 pads every shard to the chunk size)."""

    @property
    def numel(self) -> int:
        return prod(self.shape)


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part ``index`` of ``size`` split as torch.chunk splits (ceil-sized parts)."""
    step = -(-size // parts)
    start = min(size, index * step)
    return start, max(0, min(size, start + step) - start)


def expert_shard_dim(num_experts: int, layout: Layout) -> int:
    """The dim FSDP2 splits a layer's experts on (``apply_fsdp``'s rule)."""
    return 0 if (num_experts // layout.ep) % layout.replicas == 0 else 1


def fsdp_wraps_experts(layout: Layout) -> bool:
    """FSDP2 shards the experts over the replicas unless every rank owns its experts outright."""
    return layout.dense_parallel == "fsdp" and layout.replicas > 1


def local_block(param: ParamInfo, layout: Layout, rank: int, *, vocab_params: frozenset[str] = frozenset()) -> Block:
    """The block of ``param`` that global rank ``rank`` holds."""
    shape = param.shape
    i, j = layout.coordinate(rank)
    if param.expert:
        per_rank = shape[0] // layout.ep
        offset, local = [j * per_rank, *([0] * (len(shape) - 1))], [per_rank, *shape[1:]]
        if not fsdp_wraps_experts(layout):
            return Block(tuple(offset), tuple(local), prod(local))
        dim = expert_shard_dim(shape[0], layout)
        start, length = chunk(local[dim], layout.replicas, i)
        padded = list(local)
        padded[dim] = -(-local[dim] // layout.replicas)
        offset[dim] += start
        local[dim] = length
        return Block(tuple(offset), tuple(local), prod(padded))
    sharded = layout.dense_parallel == "fsdp" or (layout.vocab_parallel and param.name in vocab_params)
    if not sharded:
        return Block((0,) * len(shape), shape, prod(shape))
    start, length = chunk(shape[0], layout.world, rank)
    padded_rows = -(-shape[0] // layout.world)
    rest = prod(shape[1:])
    if layout.dense_parallel == "replicate":  # vocabulary-parallel: DTensor's Shard(0) holds no padding
        padded_rows = length
    return Block((start, *([0] * (len(shape) - 1))), (length, *shape[1:]), padded_rows * rest)


@dataclass(frozen=True)
class RankState:
    """Bytes of one rank's parameters, gradients and optimizer states."""

    params_local: int
    """From the local blocks (what the DTensors' ``to_local()`` shapes hold)."""
    params_allocated: int
    """What the rank allocates for them (FSDP2's padded shards)."""
    grads_local: int
    grads_allocated: int
    optimizer: int
    """AdamW's two moments per trainable element, in the state dtype (``optimizer_bytes`` each)."""
    buffers: int


def vocab_param_names(inventory: Inventory) -> frozenset[str]:
    """The embedding and LM head weights (vocabulary-sized, split under ``vocab_parallel``)."""
    return frozenset(p.name for p in inventory.params if p.shape and p.shape[0] == inventory.vocab and len(p.shape) == 2
                     and not p.expert)


def rank_state(inventory: Inventory, layout: Layout, rank: int = 0, *, param_bytes: int | None = None,
               grad_bytes: int | None = None, optimizer_bytes: int | None = None) -> RankState:
    """One rank's state. Element sizes default to each parameter's own (bf16 weights: 2; moetune's
    AdamW keeps its moments in the parameter's dtype); pass them to plan other precisions."""
    key = ("rank_state", layout, rank, param_bytes, grad_bytes, optimizer_bytes)
    return inventory.memoized(key, lambda: _rank_state(inventory, layout, rank, param_bytes, grad_bytes, optimizer_bytes))


def _rank_state(inventory: Inventory, layout: Layout, rank: int, param_bytes: int | None, grad_bytes: int | None,
                optimizer_bytes: int | None) -> RankState:
    vocab = vocab_param_names(inventory) if layout.vocab_parallel else frozenset()
    totals = dict(params_local=0, params_allocated=0, grads_local=0, grads_allocated=0, optimizer=0)
    for param in inventory.params:
        block = local_block(param, layout, rank, vocab_params=vocab)
        p_bytes = param_bytes or param.dtype_bytes
        totals["params_local"] += block.numel * p_bytes
        totals["params_allocated"] += block.allocated * p_bytes
        if param.trainable:
            g_bytes = grad_bytes or param.dtype_bytes
            totals["grads_local"] += block.numel * g_bytes
            totals["grads_allocated"] += block.allocated * g_bytes
            totals["optimizer"] += 2 * block.numel * (optimizer_bytes or param.dtype_bytes)
    return RankState(**totals, buffers=inventory.buffer_bytes)


def all_blocks(param: ParamInfo, layout: Layout, *, vocab_params: frozenset[str] = frozenset()) -> dict[int, Block]:
    """Every rank's block of ``param`` (the loading plan of that parameter: rank -> what it reads)."""
    return {rank: local_block(param, layout, rank, vocab_params=vocab_params) for rank in range(layout.world)}


def tiles_exactly_once(shape: tuple[int, ...], blocks: list[Block]) -> bool:
    """Whether the distinct non-empty ``blocks`` cover every element of ``shape`` exactly once
    (replicas, equal blocks on several ranks, count once). Checked on the grid of the blocks' cut
    points, so the cost is the number of blocks, not of elements."""
    distinct = {(b.offset, b.shape) for b in blocks if b.numel}
    if sum(prod(s) for _, s in distinct) != prod(shape):
        return False
    cuts = [sorted({0, size} | {o[d] for o, _ in distinct} | {o[d] + s[d] for o, s in distinct})
            for d, size in enumerate(shape)]
    index = [{c: k for k, c in enumerate(dim_cuts)} for dim_cuts in cuts]
    cells: dict[tuple[int, ...], int] = {}
    for offset, size in distinct:
        ranges = [range(index[d][offset[d]], index[d][offset[d] + size[d]]) for d in range(len(shape))]
        for cell in _product(ranges):
            cells[cell] = cells.get(cell, 0) + 1
    total_cells = prod(len(c) - 1 for c in cuts)
    return len(cells) == total_cells and all(count == 1 for count in cells.values())


def _product(ranges: list[range]):
    if not ranges:
        yield ()
        return
    for first in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (first, *rest)
