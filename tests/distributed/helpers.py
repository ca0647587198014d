"""Spawning gloo process groups on the CPU, and the single-process reference they are checked against.

The global loss of one step is defined as (sum of the token losses of all ranks' micro-batches) /
(number of valid target tokens over all ranks), which is what one process computes on the
concatenated batch. Each rank passes ``num_items_in_batch = global_count / world`` so its loss is
``world x (its share of the global loss)``; FSDP2 averages gradients over the ``world`` ranks, so the
gradients equal those of the global loss exactly (no assumption of equal token counts per rank).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SEQ = 10
MICRO_BATCH = 2


def _done_marker(store_file: str, rank: int) -> str:
    return f"{store_file}.done{rank}"


def _entry(rank: int, world_size: int, store_file: str, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # A file rendezvous: no TCP port to race for with other test runs on the same machine.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    Path(_done_marker(store_file, rank)).touch()  # every check of this rank ran and passed
    dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's threads sometimes abort it ("terminate called without an
    # active exception", SIGABRT) after a finished, correct run; the moetune CLI's workers do the same.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Workers fork from one forkserver that imported torch / transformers / moetune once (a fresh
# interpreter per worker spends ~10 s importing on a 2-core machine; plain fork after the parent
# used OpenMP can hang).
_PRELOAD = ["torch", "transformers", "moetune", "moetune.distributed", "tests.distributed.workers"]


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; re-raises a worker's failure."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="moetune-dist-") as folder:
        store_file = os.path.join(folder, "rendezvous")
        try:
            mp.start_processes(
                _entry, args=(world_size, store_file, fn, args), nprocs=world_size, join=True, start_method="forkserver"
            )
        except mp.ProcessExitedException as err:
            finished = all(os.path.exists(_done_marker(store_file, r)) for r in range(world_size))
            if not (finished and err.signal_name):
                raise
            # Every rank had passed its checks and the final barrier: the signal came from gloo's
            # teardown (seen rarely: SIGABRT with a glibc heap message), not from the code under test.
            warnings.warn(f"process {err.error_index} died of {err.signal_name} in gloo's teardown after every rank passed")


def micro_batch(step: int, rank: int, vocab: int, *, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of ``step`` (ids, labels); a few labels are ignored (-100), a
    different number per rank, so token counts differ between ranks."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (MICRO_BATCH, seq), generator=gen)
    labels = ids.clone()
    labels[0, : rank + step % 3] = -100
    return ids, labels


def valid_targets(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def global_batch(step: int, world_size: int, vocab: int, *, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [micro_batch(step, r, vocab, seq=seq) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def distributed_output(model, step: int, rank: int, world_size: int, vocab: int, *, seq: int = SEQ, **kwargs):
    """This rank's model output; its loss is this rank's term (see the module docstring): the global
    loss is the rank mean of the losses. ``kwargs`` go to the model (``return_logits=True``)."""
    ids, labels = micro_batch(step, rank, vocab, seq=seq)
    count = sum(valid_targets(micro_batch(step, r, vocab, seq=seq)[1]) for r in range(world_size))
    return model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(count / world_size), **kwargs)


def distributed_loss(model, step: int, rank: int, world_size: int, vocab: int) -> torch.Tensor:
    return distributed_output(model, step, rank, world_size, vocab).loss


def global_loss_value(loss: torch.Tensor, world_size: int) -> float:
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world_size


def reference_output(model, step: int, world_size: int, vocab: int, *, seq: int = SEQ, **kwargs):
    """One process on all ranks' micro-batches concatenated (rank r's rows are r*MICRO_BATCH...)."""
    ids, labels = global_batch(step, world_size, vocab, seq=seq)
    return model(input_ids=ids, labels=labels, **kwargs)


def reference_loss(model, step: int, world_size: int, vocab: int) -> torch.Tensor:
    return reference_output(model, step, world_size, vocab).loss


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@dataclass
class DispatchCase:
    """Tokens routed at random for the dispatcher-alone tests, and per-expert weights [E, H] for
    ``scaled_rows_experts``; ``gen`` draws anything more."""

    x: torch.Tensor
    weights: torch.Tensor
    routing: object  # moetune.moe.Routing
    probe: torch.Tensor
    weight_EH: torch.Tensor
    gen: torch.Generator

    def run(self, dispatcher, experts, *, num_experts: int):
        """The dispatcher's output and the gradients of the tokens, routing weights and expert weights."""
        out = dispatcher.run(self.x, self.routing, experts, num_experts=num_experts)
        return out, torch.autograd.grad((out * self.probe).sum(), [self.x, self.weights, self.weight_EH])


def dispatch_case(
    rank: int, *, num_tokens: int, num_experts: int = 8, hidden: int = 4, top_k: int = 2, first_experts_only: int = 0,
    num_local: int = 1,
) -> DispatchCase:  # fmt: skip
    """``num_tokens`` tokens of rank ``rank``, each routed to ``top_k`` random experts; the first
    ``first_experts_only`` tokens to the first ``num_local`` experts only (rank 0's)."""
    from moetune.moe import Routing

    weight_EH = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    gen = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if first_experts_only:
        experts[:first_experts_only] = torch.stack(
            [torch.randperm(num_local, generator=gen)[:top_k] for _ in range(first_experts_only)]
        )
    weights = torch.rand(num_tokens, top_k, generator=gen, requires_grad=True)
    routing = Routing(torch.zeros(num_tokens, num_experts), weights, experts)
    return DispatchCase(x, weights, routing, torch.randn(num_tokens, hidden, generator=gen), weight_EH, gen)


def scaled_rows_experts(weight_EH: torch.Tensor, first_expert: int, *, seen: list | None = None):
    """Experts for the dispatcher-alone tests: each row of local expert l times ``weight_EH[first_expert
    + l]``; the padding rows past the counts come out NaN, which must reach no output or gradient.
    ``seen`` collects each call's (rows, counts)."""

    def experts(x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        if seen is not None:
            seen.append((x_MH.detach(), counts_L))
        valid = int(counts_L.sum())
        local_M = torch.repeat_interleave(torch.arange(counts_L.numel()), counts_L, output_size=valid)
        out = x_MH[:valid] * weight_EH[first_expert + local_M]
        return torch.cat([out, torch.full((x_MH.shape[0] - valid, x_MH.shape[1]), float("nan"))])

    return experts
