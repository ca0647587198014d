"""Bodies of the bucketed-row-count tests of the all-to-all dispatchers (``bucket_rows``): the experts
get ``bucketed_row_count`` rows, the padding rows never reach an output or a gradient, and results
equal the unbucketed dispatch's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetune.distributed import ExpertParallelDispatcher, PipelinedExpertParallelDispatcher
from moetune.distributed.dispatcher import bucketed_row_count
from moetune.distributed.parallelize import moe_blocks
from moetune.moe import LocalTokenDispatcher
from tests.distributed.helpers import dispatch_case, scaled_rows_experts
from tests.distributed.workers import host_syncs, one_step_parity


def bucketed_dispatch(rank: int, world_size: int) -> None:
    """The dispatchers alone, with experts that scale each row by a weight of its expert and output NaN
    for padding rows: output and gradients (tokens, routing weights, expert weights) equal the
    unbucketed dispatch's and the local dispatcher's, so no padding row leaked; the experts got
    ``bucketed_row_count`` rows, zeros past their counts; still one host sync per call."""
    num_experts = 8
    first, group = rank * (num_experts // world_size), dist.group.WORLD
    case = dispatch_case(rank, num_tokens=21, num_experts=num_experts)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def run(dispatcher, first_expert: int, seen_by_experts: list | None = None):
        experts = scaled_rows_experts(case.weight_EH, first_expert, seen=seen_by_experts)
        return case.run(dispatcher, experts, num_experts=num_experts)

    local_out, local_grads = run(LocalTokenDispatcher(), 0)
    dispatchers = (
        lambda bucket_rows: ExpertParallelDispatcher(group=group, ep_size=world_size, bucket_rows=bucket_rows),
        lambda bucket_rows: PipelinedExpertParallelDispatcher(
            group=group, ep_size=world_size, num_chunks=2, bucket_rows=bucket_rows
        ),
    )
    padded_somewhere = False
    for make in dispatchers:
        plain, dispatcher = make(False), make(True)
        seen.clear()
        expected, expected_grads = run(plain, first, seen)
        assert all(rows.shape[0] == counts.sum() for rows, counts in seen), f"{plain!r} padded its rows"
        seen.clear()
        with host_syncs() as syncs:
            out, grads = run(dispatcher, first, seen)
        assert syncs.count("tolist") == 1, f"{dispatcher!r}: host syncs {syncs}"  # the one count exchange
        for rows, counts in seen:
            valid = int(counts.sum())
            assert rows.shape[0] == bucketed_row_count(valid), f"{dispatcher!r}: {rows.shape[0]} rows for {valid}"
            assert torch.equal(rows[valid:], torch.zeros_like(rows[valid:])), f"{dispatcher!r}: padding rows not zeros"
            padded_somewhere |= rows.shape[0] > valid
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(out, local_out)
        for got, want, local, name in zip(grads, expected_grads, local_grads, ("tokens", "weights", "experts")):
            assert torch.isfinite(got).all(), f"{dispatcher!r}: a padding row reached the {name}' gradient"
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            if name != "experts":  # the local run's expert gradients hold every rank's rows
                torch.testing.assert_close(got, local)
    # dispatch() alone takes the dispatcher's own choice.
    rows, counts, _ = dispatchers[0](True).dispatch(case.x, case.routing, num_experts=num_experts)
    assert rows.shape[0] == bucketed_row_count(int(counts.sum())), (rows.shape, counts)
    # Some rank received a row count (about 21) that needed padding: the checks above were not vacuous.
    padded = torch.tensor(float(padded_somewhere))
    dist.all_reduce(padded)
    assert padded.item() > 0, "no rank received a row count that needed padding"


def bucketed_model_parity(rank: int, world_size: int, folder: str) -> None:
    """A model's step with bucketed rows through moetune's GroupedExperts (the CPU backend) equals one
    process's, unchunked and in 2 chunks: the experts skip the padding rows, forward and backward."""
    padded_rows: list[int] = []

    def record(module, args) -> None:
        x, counts = args
        padded_rows.append(x.shape[0] - int(counts.sum()))

    def bucketing(model) -> None:
        for block in moe_blocks(model):
            block.dispatcher.bucket_rows = True
            block.experts.register_forward_pre_hook(record)

    for chunks in (1, 2):
        padded_rows.clear()
        one_step_parity(
            rank, world_size, folder, what=f"ep=2, {chunks} chunk(s), bucketed rows", prepare=bucketing, ep_size=2,
            ep_overlap_chunks=chunks,
        )  # fmt: skip
        assert padded_rows and all(p >= 0 for p in padded_rows), padded_rows
        some = torch.tensor(float(any(padded_rows)))
        dist.all_reduce(some)
        assert some.item() > 0, f"{chunks} chunk(s): no layer got padding rows"
