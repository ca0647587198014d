"""Worker of ``gathered_for_inference`` (generation on an FSDP2-sharded model with its parameters
gathered once), run in spawned gloo processes by tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.helpers import micro_batch


def generation_gathers_once(rank: int, world_size: int, folder: str, *, ep: int, **options) -> None:
    """Greedy generation inside ``gathered_for_inference`` equals one process's and the per-forward
    gathering's, with a fraction of the all-gathers; afterwards the parameters are the shards again
    (an optimizer built then updates the model) and the next forward gathers per forward as before."""
    from torch.distributed.tensor import DTensor

    from moetune.distributed.inference import gathered_for_inference
    from tests.distributed.workers import _load

    model, ref = _load(folder, ep_size=ep, **options), _load(folder)
    model.eval()
    ref.eval()
    ids, _ = micro_batch(3, rank, 64)
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    shards = {name: p.to_local().shape for name, p in model.named_parameters() if isinstance(p, DTensor)}
    with torch.no_grad(), _counting_all_gathers() as per_forward:
        plain = model.generate(ids, **settings)
    with torch.no_grad(), _counting_all_gathers() as gathered_once, gathered_for_inference(model) as gathered:
        kept = model.generate(ids, **settings)
    assert gathered, "gathered_for_inference declined on a tiny model"
    with torch.no_grad():
        expected = ref.generate(ids, **settings)
    assert torch.equal(plain, expected) and torch.equal(kept, expected), "generation differs from one process"
    assert gathered_once[0] * 3 < per_forward[0], (gathered_once[0], per_forward[0])
    # Sharded again: the module parameters are the DTensor shards an optimizer must hold.
    for name, param in model.named_parameters():
        if name in shards:
            assert isinstance(param, DTensor) and param.to_local().shape == shards[name], name
    with torch.no_grad(), _counting_all_gathers() as again:
        model.generate(ids, **settings)
    assert again[0] == per_forward[0], (again[0], per_forward[0])


class _counting_all_gathers:
    """Counts ``all_gather_into_tensor`` calls (FSDP2's parameter gathers) inside the block."""

    def __enter__(self) -> list[int]:
        self.count = [0]
        self.names = [n for n in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
        self.originals = {n: getattr(dist, n) for n in self.names}

        def wrap(original):
            def counted(*args, **kwargs):
                self.count[0] += 1
                return original(*args, **kwargs)
            return counted

        for name in self.names:
            setattr(dist, name, wrap(self.originals[name]))
        return self.count

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
