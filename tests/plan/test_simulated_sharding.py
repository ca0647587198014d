"""Proof by simulation: moetune's real ``parallelize`` on the meta device under torch's fake process
group, one rank of a 8-256 GPU run at a time, against the planner's own account of what every
rank holds (moetune/plan/sharding.py).

For each model (each family at the scale it is fine-tuned at) the model is cut to a few layers that
hold every kind of layer the full model has (checked), and a few ranks of each world size are
simulated: first, last and one inside. Checked per rank: every parameter's block (offset and
shape) from the DTensors, FSDP2's padded allocation, the parameter / gradient / optimizer-state
bytes (moetune's AdamW states created on the meta device), the mesh and the process groups behind
it, the experts each rank holds, and what the checkpoint loader reads. Over all ranks of the
world (the planner's blocks, equal to the DTensors' where simulated): every tensor is tiled
exactly once per set of replicas.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moetune.checkpoint.loader import plan_checkpoint_load
from moetune.moe import GroupedExperts
from moetune.optim import AdamW
from moetune.plan.inventory import build_inventory, meta_training_model
from moetune.plan.model_spec import resolve_model
from moetune.plan.sharding import (
    Layout,
    all_blocks,
    local_block,
    rank_state,
    tiles_exactly_once,
    vocab_param_names,
)
from tests.plan.simulation import (
    comparable,
    fake_world,
    fsdp_allocated,
    held_blocks,
    hub_tensors,
    parallelized_model,
    read_elements,
)

GPUS_PER_NODE = 8

# (model, layers kept, world, ep, dense_parallel, lora rank, vocab_parallel)
CASES = [
    ("qwen3_30b_a3b", 2, 8, 8, "fsdp", 0, False),
    ("nemotron_3_nano_30b_a3b", 6, 8, 8, "fsdp", 0, False),  # M E M E M *: every block kind
    ("qwen3_30b_a3b", 2, 8, 4, "replicate", 0, True),
    ("qwen3_235b_a22b", 2, 64, 8, "fsdp", 0, False),
    ("qwen3_235b_a22b", 2, 64, 8, "fsdp", 16, False),  # LoRA adapters on attention and experts
    ("gpt_oss_120b", 2, 64, 64, "fsdp", 0, False),
    ("deepseek_v3", 4, 64, 8, "fsdp", 0, False),  # 3 dense layers, then MoE
    ("deepseek_v3", 4, 128, 32, "fsdp", 0, False),
    ("deepseek_v3", 4, 256, 64, "fsdp", 0, False),
    ("kimi_k2", 2, 128, 64, "fsdp", 0, False),
    ("kimi_k2", 2, 256, 128, "fsdp", 0, False),
    ("nemotron_3_ultra_550b_a55b", 8, 128, 64, "fsdp", 0, False),  # M E M E M E M *: every block kind
]


def _ranks(world: int) -> list[int]:
    return sorted({0, world - 1, world // 2 + 3})


def _case_id(case) -> str:
    model, layers, world, ep, dense, lora, vocab = case
    return f"{model}-{layers}l-w{world}-ep{ep}-{dense}" + (f"-lora{lora}" if lora else "") + ("-vocab" if vocab else "")


@pytest.fixture(scope="module")
def setups():
    """Per case: the cut config, the planner's inventory of it, the layout and the LoRA settings."""
    built = {}
    for case in CASES:
        model, layers, world, ep, dense, lora_rank, vocab = case
        _, config = resolve_model(model, layers=layers)
        lora = None
        if lora_rank:
            from moetune.bench.lora import lora_settings

            lora = lora_settings(lora_rank, None, config)
        layout = Layout(world=world, ep=ep, dense_parallel=dense, vocab_parallel=vocab, gpus_per_node=GPUS_PER_NODE)
        built[case] = (config, build_inventory(model, config, lora=lora), layout, lora)
    return built


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_rank_holds_what_the_planner_says(case, setups):
    config, inventory, layout, lora = setups[case]
    vocab = vocab_param_names(inventory) if layout.vocab_parallel else frozenset()
    # What from_pretrained does: the checkpoint's blocks are planned on the unsharded meta-device model
    # (the base model: LoRA adapters are initialised, not read), then each rank copies its part.
    unsharded = meta_training_model(config)
    items = plan_checkpoint_load(unsharded, hub_tensors(config, unsharded.checkpoint_layout), unsharded.checkpoint_layout)
    for rank in _ranks(layout.world):
        with fake_world(rank, layout.world):
            model = parallelized_model(config, layout, lora=lora)
            blocks = held_blocks(model)
            allocated = fsdp_allocated(model)
            _check_mesh(model, layout, rank)
            optimizer = _optimizer_states_on_meta(model)
            read = read_elements(model, items)
        params = {p.name: p for p in inventory.params}
        assert set(blocks) == set(params), "the planner's inventory lists the model's parameters"
        for name, param in params.items():
            planned = local_block(param, layout, rank, vocab_params=vocab)
            assert comparable(planned.offset, planned.shape) == comparable(*blocks[name]), (rank, name)
            if name in allocated:
                assert allocated[name] == planned.allocated, (rank, name)
            # The loader reads each element this rank holds exactly once (adapters are initialised).
            assert read.get(name, 0) == (0 if "lora_" in name else planned.numel), (rank, name)
        state = rank_state(inventory, layout, rank)
        local_bytes = {n: _numel(blocks[n][1]) * params[n].dtype_bytes for n in params}
        assert state.params_local == sum(local_bytes.values())
        assert state.grads_local == sum(b for n, b in local_bytes.items() if params[n].trainable)
        assert state.optimizer == optimizer


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_tensor_is_read_exactly_once_per_set_of_replicas(case, setups):
    """The blocks of all ranks tile every parameter exactly once (ranks holding the same block,
    replicas, count once): every checkpoint tensor is then read exactly once per replica set, as
    each rank reads exactly its block (the test above)."""
    _, inventory, layout, _ = setups[case]
    vocab = vocab_param_names(inventory) if layout.vocab_parallel else frozenset()
    for param in inventory.params:
        blocks = all_blocks(param, layout, vocab_params=vocab)
        assert tiles_exactly_once(param.shape, list(blocks.values())), param.name
        replicas = {}
        for block in blocks.values():
            replicas[(block.offset, block.shape)] = replicas.get((block.offset, block.shape), 0) + 1
        expected = layout.world // _distinct_holders(param, layout, vocab)
        assert all(count == expected for key, count in replicas.items() if _numel(key[1])), param.name


@pytest.mark.parametrize("model", sorted({case[0] for case in CASES}))
def test_the_simulated_cut_holds_every_kind_of_layer_of_the_full_model(model, setups):
    """Per-layer sharding repeats: the planner's full-depth totals are exact when every kind of
    layer (its parameters' shapes and groups) was simulated."""
    _, full = resolve_model(model)
    full_inventory = build_inventory(model, full)
    cut = next(inventory for (name, *_), (_, inventory, _, lora) in setups.items() if name == model and lora is None)
    assert len(full_inventory.layers) == full.num_hidden_layers
    assert _layer_signatures(full_inventory) <= _layer_signatures(cut)
    assert _non_layer_params(full_inventory) == _non_layer_params(cut)


def _distinct_holders(param, layout: Layout, vocab: frozenset[str]) -> int:
    """How many distinct blocks a parameter is split into."""
    if param.expert:
        return layout.world if layout.dense_parallel == "fsdp" else layout.ep
    return layout.world if layout.dense_parallel == "fsdp" or param.name in vocab else 1


def _layer_signatures(inventory) -> set:
    by_layer: dict[str, list] = {}
    for p in inventory.params:
        if p.group.startswith("layers."):
            index = p.group.split(".")[1]
            suffix = p.name.split(f".layers.{index}.", 1)[1]
            by_layer.setdefault(index, []).append((suffix, p.shape, p.group.count("."), p.trainable))
    return {tuple(sorted(entries)) for entries in by_layer.values()}


def _non_layer_params(inventory) -> set:
    return {(p.name, p.shape, p.group) for p in inventory.params if not p.group.startswith("layers.")}


def _numel(shape) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _optimizer_states_on_meta(model) -> int:
    """Bytes of moetune's AdamW states for this rank's local shards, created as its first step does."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(params, lr=1e-5)
    total = 0
    for param in params:
        optimizer._init_state(param, optimizer.param_groups[0])
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state[param][key]
            local = state.to_local() if hasattr(state, "to_local") else state
            total += local.numel() * local.element_size()
    return total


def _check_mesh(model, layout: Layout, rank: int) -> None:
    """The mesh is (world / ep, ep) with ep innermost; each rank's groups are the ones the planner's
    coordinates give; each FSDP2 group shards over the mesh the planner assumes."""
    i, j = layout.coordinate(rank)
    experts_meshes, world_meshes = set(), set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            fsdp_mesh = module._get_fsdp_state()._fsdp_param_group
            if fsdp_mesh is None:
                continue
            ranks = tuple(dist.get_process_group_ranks(fsdp_mesh.mesh_info.mesh.get_group()))
            (experts_meshes if isinstance(module, GroupedExperts) else world_meshes).add(ranks)
    expected_replicas = tuple(range(j, layout.world, layout.ep))
    assert experts_meshes <= {expected_replicas}, experts_meshes
    assert world_meshes <= {tuple(range(layout.world))}, world_meshes
    ep_group = tuple(range(i * layout.ep, (i + 1) * layout.ep))
    for param in model.parameters():
        placements = getattr(param, "placements", ())
        if len(placements) == 2:  # expert weights: (dp_shard_mod_ep, ep)
            assert tuple(param.device_mesh.get_coordinate()) == (i, j)
            assert tuple(dist.get_process_group_ranks(param.device_mesh.get_group("ep"))) == ep_group
            if layout.ep <= layout.gpus_per_node:  # the token all-to-all stays inside a node
                assert len({r // layout.gpus_per_node for r in ep_group}) == 1
