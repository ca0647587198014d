"""Expert parallelism with FP8 layers (reference backend, gloo on CPU), checked against one process."""

from __future__ import annotations

from moetune.models.fp8 import fp8_layers
from tests.distributed.helpers import distributed_loss, gathered, global_loss_value, reference_loss, rel_err
from tests.distributed.workers import ALLGATHER_REPLICATE, _load

VOCAB = 64


def fp8_expert_parallel_parity(rank: int, world_size: int, folder: str) -> None:
    """ep=2 (all-to-all + FSDP2, and all-gather + replicated) with ``fp8`` equals one process with the
    same ``fp8``: the loss and the experts' gradients up to fp32 summation order (every FP8 scale is
    per token, per weight row / tile, or per expert over all of its tokens, wherever they were
    computed); the other weights' gradients within FP8's error (data parallelism scales each rank's
    token columns apart)."""
    for recipe in ("rowwise", "blockwise"):
        fp8 = {"fp8": recipe, "fp8_backend": "reference"}
        for options in ({}, ALLGATHER_REPLICATE):
            what = f"fp8={recipe}, ep=2 {options or 'all-to-all + FSDP2'}"
            model, ref = _load(folder, ep_size=2, **fp8, **options), _load(folder, **fp8)
            assert fp8_layers(model) == fp8_layers(ref) and fp8_layers(model), what
            loss = distributed_loss(model, 0, rank, world_size, VOCAB)
            loss.backward()
            expected = reference_loss(ref, 0, world_size, VOCAB)
            expected.backward()
            got = global_loss_value(loss, world_size)
            assert abs(got - expected.item()) <= 1e-5 * abs(expected.item()), f"{what}: loss {got} vs {expected.item()}"
            ref_params = dict(ref.named_parameters())
            for name, param in model.named_parameters():
                err = rel_err(gathered(param.grad), ref_params[name].grad)
                assert err < (1e-4 if ".experts." in name else 0.1), f"{what}: gradient of {name} differs by {err:.2e}"
