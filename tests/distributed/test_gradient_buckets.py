"""``ReplicatedGradientSync`` with buckets (``bucket_mb``): gradients reduced in a few flat all-reduces
equal the per-parameter reduction and the plain average of the ranks' gradients, in every case the
per-parameter path handles (run in 2 gloo processes)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from moetune.distributed.replicate import ReplicatedGradientSync, no_gradient_sync
from tests.distributed.helpers import spawn

WIDTH = 16
# 16 x 16 fp32 weights are 1 KiB: three of them (with their biases) fill one 4 KiB bucket.
BUCKET_MB = 4 / 1024


class _Stack(nn.Module):
    def __init__(self, layers: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.big = nn.Parameter(torch.randn(WIDTH, 128))  # 8 KiB: larger than a bucket, reduced in place

    def forward(self, x, *, skip: int | None = None, reentrant: bool = False):
        for index, layer in enumerate(self.layers):
            if index == skip:
                continue
            block = lambda t, layer=layer: torch.tanh(layer(t))  # noqa: E731
            x = checkpoint(block, x, use_reentrant=True) if reentrant and index == 1 else block(x)
        return (x @ self.big).square().mean()


def _model() -> _Stack:
    torch.manual_seed(0)
    return _Stack()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank), requires_grad=True)


def _averaged_reference(model: _Stack, step: int, world: int, **kwargs) -> dict[str, torch.Tensor]:
    """The average of every rank's gradient, computed in this process."""
    model.zero_grad(set_to_none=True)
    for rank in range(world):
        model(_batch(step, rank), **kwargs).div(world).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: gradients of {sorted(got)} vs {sorted(want)}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}, {name}: {m}")


def bucket_worker(rank: int, world: int) -> None:
    bucketed, per_param, reference = _model(), _model(), _model()
    group = dist.group.WORLD
    sync = ReplicatedGradientSync(bucketed.parameters(), group=group, bucket_mb=BUCKET_MB)
    plain = ReplicatedGradientSync(per_param.parameters(), group=group, bucket_mb=None)
    for step in range(3):
        for model in (bucketed, per_param):
            model.zero_grad(set_to_none=True)
            model(_batch(step, rank)).backward()
        assert sync.num_buckets >= 2 and plain.num_buckets == 0, (sync.num_buckets, plain.num_buckets)
        want = _averaged_reference(reference, step, world)
        _assert_close(_grads(bucketed), want, f"bucketed, step {step}")
        assert all(torch.equal(a, b) for a, b in zip(_grads(bucketed).values(), _grads(per_param).values()))
    # Buckets hold several parameters each; the large weight is in none of them.
    bucketed_ids = {id(p) for bucket in sync._buckets for p in bucket.params}
    assert id(bucketed.big) not in bucketed_ids and len(bucketed_ids) >= 6

    # A layer left out of the forward: its bucket is reduced at the end of the backward with what came;
    # the unused parameters keep no gradient.
    bucketed.zero_grad(set_to_none=True)
    bucketed(_batch(5, rank), skip=2).backward()
    _assert_close(_grads(bucketed), _averaged_reference(reference, 5, world, skip=2), "a layer unused")

    # Gradient accumulation: the first backward unreduced (no_sync), the second reduces the sum once.
    bucketed.zero_grad(set_to_none=True)
    with no_gradient_sync([sync]):
        bucketed(_batch(6, rank)).backward()
    bucketed(_batch(7, rank)).backward()
    want6, want7 = _averaged_reference(reference, 6, world), _averaged_reference(reference, 7, world)
    _assert_close(_grads(bucketed), {name: want6[name] + want7[name] for name in want6}, "no_sync, then a reduced backward")

    # Gradients kept between steps (zero_grad(set_to_none=False)): the backward accumulates into the
    # same tensors, which the bucket copies into and back from.
    bucketed.zero_grad(set_to_none=False)
    before = {name: p.grad for name, p in bucketed.named_parameters()}
    bucketed(_batch(8, rank)).backward()
    assert all(p.grad is before[name] for name, p in bucketed.named_parameters()), "a bucket replaced a .grad tensor"
    _assert_close(_grads(bucketed), _averaged_reference(reference, 8, world), "gradients kept between steps")

    # Reentrant checkpointing: the recomputed layer's gradients come from a nested backward; they are
    # reduced on their own (with a warning) and the rest of their bucket still is.
    bucketed.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bucketed(_batch(9, rank), reentrant=True).backward()
    assert any("nested backward" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _assert_close(_grads(bucketed), _averaged_reference(reference, 9, world), "reentrant checkpointing")

    # after_reduction: a bucketed parameter's callback runs once its bucket's all-reduce is issued,
    # which is after the last gradient of the bucket arrived; wait_for then gives the average.
    seen: list[tuple[str, bool]] = []
    names = {id(p): name for name, p in bucketed.named_parameters()}

    def on_grad(param):
        def callback():
            launched = sync._bucket_of[id(param)].reduction is not None if id(param) in sync._bucket_of else True
            assert sync.wait_for(param), names[id(param)]
            seen.append((names[id(param)], launched))

        sync.after_reduction(param, callback)

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in bucketed.parameters()]
    bucketed.zero_grad(set_to_none=True)
    bucketed(_batch(10, rank)).backward()
    for hook in hooks:
        hook.remove()
    assert sorted(name for name, _ in seen) == sorted(names.values()) and all(launched for _, launched in seen), seen
    _assert_close(_grads(bucketed), _averaged_reference(reference, 10, world), "after_reduction callbacks")


def test_bucketed_gradients_equal_the_average():
    spawn(bucket_worker, 2)


@pytest.mark.parametrize("bucket_mb", [-1, True, "64"])
def test_bucket_size_must_be_a_number(bucket_mb):
    from moetune.options import MoetuneOptions

    with pytest.raises(ValueError, match="replicate_bucket_mb must be a number"):
        MoetuneOptions(replicate_bucket_mb=bucket_mb)
