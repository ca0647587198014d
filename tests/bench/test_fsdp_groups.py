"""The Transformers side's FSDP2 groups: one dtype per group (FSDP2 refuses mixed groups), so a
layer whose parameters mix dtypes is split into its children first."""

from __future__ import annotations

import torch
from torch import nn

from moetune.bench.models import _fully_shard_by_dtype


def test_mixed_dtype_layers_are_grouped_by_child_and_uniform_ones_whole():
    class Mixer(nn.Module):  # Mamba-2-like: bf16 projections, fp32 per-head parameters held directly
        def __init__(self):
            super().__init__()
            self.in_proj = nn.Linear(4, 4).bfloat16()
            self.A_log = nn.Parameter(torch.zeros(2))

    layer = nn.Sequential(nn.Linear(4, 4).bfloat16(), Mixer(), nn.Linear(4, 4, bias=False).float())
    sharded = []

    def fully_shard(module, *, mesh):
        assert mesh == "mesh"
        managed = {id(p) for m in sharded for p in m.parameters()}
        left = [p for p in module.parameters() if id(p) not in managed]
        assert len({p.dtype for p in left}) <= 1, f"mixed dtypes in one group: {module}"
        sharded.append(module)

    _fully_shard_by_dtype(layer, fully_shard, "mesh")
    assert sharded == [layer[0], layer[1].in_proj, layer[1], layer[2], layer]
    sharded.clear()
    uniform = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    _fully_shard_by_dtype(uniform, fully_shard, "mesh")
    assert sharded == [uniform]
