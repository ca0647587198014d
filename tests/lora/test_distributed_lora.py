"""LoRA on 2 gloo ranks (CPU): expert adapters on expert-parallel weights (each rank holds E/2
experts), and a LoRA model sharded by FSDP2 after apply_lora training like one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.distributed.helpers import spawn

_WORLD = 2
_E, _H, _I, _R, _SCALING = 4, 8, 4, 2, 0.5


def _checks(rank: int, world_size: int) -> None:
    _check_expert_parallel(rank)
    _check_fsdp2(rank)


def _check_expert_parallel(rank: int) -> None:
    from moetune.lora.experts import add_expert_adapters, lora_a_name, lora_b_name, merge_expert_adapters
    from moetune.lora.peft_export import peft_adapter_state_dict
    from moetune.moe import GroupedExperts

    mesh = init_device_mesh("cpu", (_WORLD,), mesh_dim_names=("ep",))
    generator = torch.Generator().manual_seed(0)  # same global values on both ranks
    full = {name: torch.randn(shape, generator=generator) for name, shape in
            (("gate_up_proj", (_E, 2 * _I, _H)), ("down_proj", (_E, _H, _I)))}
    experts = GroupedExperts(num_experts=_E, hidden_size=_H, intermediate_size=_I, backend="loop")
    for name, value in full.items():
        setattr(experts, name, nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]), requires_grad=False))

    add_expert_adapters(experts, ("gate_up_proj", "down_proj"), rank=_R, scaling=_SCALING, dtype=torch.float32)
    adapters = {}
    with torch.no_grad():
        for name in full:
            for adapter_name in (lora_a_name(name), lora_b_name(name)):
                param = experts._parameters[adapter_name]
                assert isinstance(param, DTensor) and param.placements == (Shard(0),)
                assert param.to_local().shape[0] == _E // _WORLD
                adapters[adapter_name] = torch.randn(param.shape, generator=generator)
                param.copy_(distribute_tensor(adapters[adapter_name], mesh, [Shard(0)]))

    # This rank's experts see their own W_e + s * B_e @ A_e.
    counts = torch.tensor([3, 2])
    x_NH = torch.randn(int(counts.sum()), _H, generator=torch.Generator().manual_seed(1 + rank))
    out = experts(x_NH, counts)
    reference = GroupedExperts(num_experts=_E // _WORLD, hidden_size=_H, intermediate_size=_I, backend="loop")
    local = slice(rank * _E // _WORLD, (rank + 1) * _E // _WORLD)
    with torch.no_grad():
        for name, value in full.items():
            delta = _SCALING * adapters[lora_b_name(name)][local] @ adapters[lora_a_name(name)][local]
            getattr(reference, name).copy_(value[local] + delta)
    expected = reference(x_NH, counts)
    torch.testing.assert_close(out, expected)

    out.square().sum().backward()
    assert all(experts._parameters[lora_a_name(n)].grad is not None for n in full)

    exported = peft_adapter_state_dict(experts)  # gathers all experts (collective)
    torch.testing.assert_close(exported["base_model.model.lora_A.weight"],
                               adapters["lora_A_down_proj"].reshape(_E * _R, _I))

    merge_expert_adapters(experts)  # folds each rank's delta into its own shard
    assert type(experts) is GroupedExperts and isinstance(experts.down_proj, DTensor)
    torch.testing.assert_close(experts(x_NH, counts), expected)


def _check_fsdp2(rank: int) -> None:
    import copy

    from torch.distributed.fsdp import fully_shard

    from moetune.lora import LoraSettings, apply_lora, lora_state_dict

    from .helpers import build_moetune_model, randomize_adapters, tiny_qwen3_moe_config

    model = apply_lora(build_moetune_model(tiny_qwen3_moe_config()).train(), LoraSettings(rank=2))
    randomize_adapters(model)  # same values on both ranks (fixed generator)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (_WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batches = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(10 + r)) for r in range(_WORLD)]

    def step(m, batch_list) -> None:
        # SGD: the update is linear in the gradient (Adam's first step is about sign(g), so tiny
        # reduction-order differences would flip near-zero entries).
        optimizer = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        # FSDP2 averages gradients over ranks: the reference averages the losses of both batches.
        loss = sum(m(b, labels=b).loss for b in batch_list) / len(batch_list)
        loss.backward()
        optimizer.step()

    step(model, [batches[rank]])
    step(reference, batches)
    sharded = lora_state_dict(model)
    for name, expected in lora_state_dict(reference).items():
        assert isinstance(sharded[name], DTensor), name
        torch.testing.assert_close(sharded[name].full_tensor(), expected, rtol=1e-4, atol=1e-6, msg=name)
    # The base weights are untouched and bit-identical to the unsharded model's.
    base = {k: v for k, v in reference.state_dict().items() if ".lora_" not in k}
    for name, value in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, base[name]), name


@pytest.mark.distributed
def test_lora_under_expert_parallelism_and_fsdp2():
    spawn(_checks, _WORLD)
