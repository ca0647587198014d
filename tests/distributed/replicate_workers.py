"""Workers of the replicated expert-parallel tests (``ep_dispatch="allgather"``,
``dense_parallel="replicate"``: the CUDA-graph capturable step): run in spawned gloo processes by
tests/distributed/test_expert_parallel.py, each rank comparing against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import moetune
from tests.distributed.helpers import SEQ, dispatch_case, distributed_loss, gathered, reference_loss, scaled_rows_experts
from tests.distributed.workers import (
    ADAM_EPS,
    ADAM_LR,
    ALLGATHER_REPLICATE,
    _compare_grads,
    _load,
    dcp_resume,
    one_step_parity,
    rebalanced_experts_parity,
    train_parity,
)


def check_replicas_equal_after_from_config(rank: int, world_size: int, *, ep: int) -> None:
    """``from_config`` with a different seed on every rank: the replicated copies (non-expert parameters
    on all ranks, each expert shard on the ranks that hold it) are broadcast equal."""
    from tests.conftest import tiny_qwen3_moe_config

    torch.manual_seed(rank)
    model = moetune.AutoModelForCausalLM.from_config(
        tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False), ep_size=ep, **ALLGATHER_REPLICATE
    )
    replicas = model.parallel_mesh.dp_shard_mod_ep.get_group()
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param.detach()
        group = replicas if isinstance(param, DTensor) else None
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, local.contiguous(), group=group)
        assert all(torch.equal(copy, copies[0]) for copy in copies), f"{name}: replicas differ"




def allgather_and_replicate_suite(rank: int, world_size: int, folder: str, out: str) -> None:
    """``ep_dispatch='allgather'`` and ``dense_parallel='replicate'`` (the CUDA-graph capturable
    expert-parallel step): the dispatcher alone equals the local one; training (SGD + clipping +
    AdamW), save, DCP resume and activation checkpointing equal one process; from_config gives every
    rank the same non-expert weights; the all-gather dispatcher under FSDP2; unequal token counts."""
    allgather_dispatcher(rank, world_size)
    train_parity(rank, world_size, folder, world_size, out, **ALLGATHER_REPLICATE)
    dcp_resume(rank, world_size, folder, world_size, out, **ALLGATHER_REPLICATE)
    one_step_parity(
        rank, world_size, folder, what="allgather + replicate + AC", ep_size=world_size, enable_ac=True, **ALLGATHER_REPLICATE
    )
    one_step_parity(rank, world_size, folder, what="allgather + FSDP2", ep_size=world_size, ep_dispatch="allgather")
    # Gradient accumulation: each backward all-reduces the accumulated gradients again; still the average.
    model, ref = _load(folder, ep_size=world_size, **ALLGATHER_REPLICATE), _load(folder)
    for step in (0, 1):
        distributed_loss(model, step, rank, world_size, 64).backward()
        reference_loss(ref, step, world_size, 64).backward()
    _compare_grads(model, ref, what="allgather + replicate, two accumulated backwards")
    # The same with the first backward inside model.no_sync() (DDP's name, which accelerate and the
    # recipe call): left unreduced there (the ranks' gradients differ), averaged by the last backward.
    model = _load(folder, ep_size=world_size, **ALLGATHER_REPLICATE)
    with model.no_sync():
        distributed_loss(model, 0, rank, world_size, 64).backward()
    head = model.get_output_embeddings().weight.grad
    copies = [torch.empty_like(head) for _ in range(world_size)]
    dist.all_gather(copies, head)
    assert not torch.equal(copies[0], copies[1]), "no_sync() still all-reduced the gradients"
    distributed_loss(model, 1, rank, world_size, 64).backward()
    _compare_grads(model, ref, what="allgather + replicate, no_sync() then a synchronised backward")
    uneven_sequences_replicated(rank, world_size, folder)
    overlapped_optimizer_replicated(rank, world_size, folder)
    rebalanced_experts_parity(rank, world_size, folder, **ALLGATHER_REPLICATE)
    resized_vocabulary_replicated(rank, world_size, folder)
    # torch's multi-tensor AdamW cannot take plain and DTensor parameters in one list: a clear error.
    import pytest

    model = _load(folder, ep_size=world_size, **ALLGATHER_REPLICATE)
    distributed_loss(model, 0, rank, world_size, 64).backward()
    with pytest.raises(ValueError, match="mixes replicated plain parameters with expert-parallel DTensors"):
        torch.optim.AdamW(model.parameters(), foreach=True).step()
    torch.optim.AdamW(model.parameters(), foreach=False).step()  # works, as does moetune.optim.AdamW

    from tests.conftest import tiny_qwen3_moe_config

    torch.manual_seed(rank)  # different on every rank: the broadcast must make the copies equal
    fresh = moetune.AutoModelForCausalLM.from_config(
        tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False), ep_size=world_size, **ALLGATHER_REPLICATE
    )
    for name, param in fresh.named_parameters():
        if not isinstance(param, DTensor):
            copies = [torch.empty_like(param.data) for _ in range(world_size)]
            dist.all_gather(copies, param.data.contiguous())
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs between ranks after from_config"


def overlapped_optimizer_replicated(
    rank: int, world_size: int, folder: str, *, ep: int | None = None, options: dict = ALLGATHER_REPLICATE
) -> None:
    """``CUDAGraphTrainStep(overlap_optimizer=True)`` (off CUDA: the updates run from the gradient
    hooks) on a replicated expert-parallel model: each replicated parameter is updated from its
    averaged gradient (the hook waits for its all-reduce), the experts from theirs; the parameters
    equal the plain loop's (backward, then AdamW) exactly, step after step. With ``ep`` < world the
    experts' updates wait for their all-reduce over the replicas too."""
    import pytest

    from moetune.optim import AdamW
    from moetune.training import CUDAGraphTrainStep

    model, plain = (_load(folder, ep_size=ep or world_size, **options) for _ in range(2))
    step = CUDAGraphTrainStep(
        model, AdamW(model.parameters(), lr=ADAM_LR, eps=ADAM_EPS), overlap_optimizer=True,
        loss_fn=lambda m, batch: distributed_loss(m, int(batch["step"]), rank, world_size, 64),
    )  # fmt: skip
    plain_optimizer = AdamW(plain.parameters(), lr=ADAM_LR, eps=ADAM_EPS)
    for i in range(3):
        loss = step(step=torch.tensor(i))
        plain_loss = distributed_loss(plain, i, rank, world_size, 64)
        plain_loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        assert loss.item() == plain_loss.item(), f"overlapped AdamW, step {i}: loss {loss.item()} vs {plain_loss.item()}"
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(gathered(a.data), gathered(b.data)), f"overlapped AdamW, step {i}: {name} differs"
    with model.no_sync(), pytest.raises(RuntimeError, match="cannot run inside model.no_sync"):
        step(step=torch.tensor(3))
    step.close()
    accumulated_once_per_step_replicated(rank, world_size, folder, ep=ep, options=options)


def accumulated_once_per_step_replicated(
    rank: int, world_size: int, folder: str, *, ep: int | None = None, options: dict = ALLGATHER_REPLICATE
) -> None:
    """``CUDAGraphTrainStep(micro_batches=2, overlap_optimizer=True)`` on a replicated model: the first
    micro-batch's gradients stay unreduced (it runs under ``model.no_sync()``), the second reduces them
    and updates during its backward; the parameters equal the plain loop's (no_sync, backward,
    backward, AdamW) exactly."""
    from moetune.optim import AdamW
    from moetune.training import CUDAGraphTrainStep

    model, plain = (_load(folder, ep_size=ep or world_size, **options) for _ in range(2))
    step = CUDAGraphTrainStep(
        model, AdamW(model.parameters(), lr=ADAM_LR, eps=ADAM_EPS), overlap_optimizer=True, micro_batches=2,
        loss_fn=lambda m, batch: distributed_loss(m, int(batch["step"]), rank, world_size, 64) / 2,
    )  # fmt: skip
    plain_optimizer = AdamW(plain.parameters(), lr=ADAM_LR, eps=ADAM_EPS)
    for i in range(2):
        step.forward_backward(step=torch.tensor(2 * i))
        replicated = next(p.grad for p in model.parameters() if model.replicated_gradient_syncs[0].reduces(p))
        copies = [torch.empty_like(replicated) for _ in range(world_size)]
        dist.all_gather(copies, replicated)
        assert not torch.equal(copies[0], copies[1]), "the first micro-batch's gradients were all-reduced"
        step.forward_backward(step=torch.tensor(2 * i + 1))
        step.optimizer_step()
        with plain.no_sync():
            (distributed_loss(plain, 2 * i, rank, world_size, 64) / 2).backward()
        (distributed_loss(plain, 2 * i + 1, rank, world_size, 64) / 2).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(gathered(a.data), gathered(b.data)), f"micro_batches=2, step {i}: {name} differs"


def resized_vocabulary_replicated(rank: int, world_size: int, folder: str) -> None:
    """``resize_token_embeddings`` after a replicated expert-parallel load (a tokenizer with added
    tokens): the new rows are equal on every rank, and one step's gradients (the new LM head's, whose
    module Transformers replaces, and the gathered input embedding's) equal one process's on the same
    resized weights."""
    vocab = 64
    torch.manual_seed(rank)  # the new rows are drawn at random: differently on every rank
    model, ref = _load(folder, ep_size=world_size, **ALLGATHER_REPLICATE), _load(folder)
    model.resize_token_embeddings(vocab + 8)
    ref.resize_token_embeddings(vocab + 8)
    for module, ref_module in ((model.get_input_embeddings(), ref.get_input_embeddings()),
                               (model.get_output_embeddings(), ref.get_output_embeddings())):  # fmt: skip
        copies = [torch.empty_like(module.weight) for _ in range(world_size)]
        dist.all_gather(copies, module.weight.detach().contiguous())
        assert all(torch.equal(c, copies[0]) for c in copies), f"resized {type(module).__name__} differs between ranks"
        ref_module.weight.data.copy_(module.weight.data)
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    dense_sync = model.replicated_gradient_syncs[0]
    assert dense_sync.reduces(head) and not dense_sync.reduces(embedding), "the resized weights' gradient sync"
    distributed_loss(model, 0, rank, world_size, vocab + 8).backward()
    reference_loss(ref, 0, world_size, vocab + 8).backward()
    _compare_grads(model, ref, what="replicate, after resize_token_embeddings")


def uneven_sequences_replicated(rank: int, world_size: int, folder: str) -> None:
    """Ranks with different sequence lengths (eager): the all-gather dispatcher pads the shorter ranks,
    and the input embedding's gradient, built from every rank's gathered tokens instead of
    all-reduced, is still the average of the ranks' gradients."""
    from moetune.distributed.replicate import _GatheredGradEmbedding

    model, ref = _load(folder, ep_size=world_size, **ALLGATHER_REPLICATE), _load(folder)
    assert isinstance(model.get_input_embeddings(), _GatheredGradEmbedding)
    # The gradients' communicator is not the experts' (ep == world: DeviceMesh gives ep the default
    # group), so their all-reduces do not queue behind each other.
    dense_group = model.replicated_gradient_syncs[0].group
    assert dense_group is not model.parallel_mesh.ep.get_group() and dense_group is not dist.group.WORLD
    batches = [torch.randint(0, 64, (1, SEQ + 3 * r), generator=torch.Generator().manual_seed(7 + r)) for r in range(world_size)]
    model(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    sum(ref(input_ids=ids, labels=ids).loss for ids in batches).div(world_size).backward()
    _compare_grads(model, ref, what="allgather + replicate, sequence lengths differ between ranks")
    # A CUDA-graph capture skips the count exchange: after an uneven eager backward it must refuse.
    import pytest

    import moetune.distributed.token_counts as token_counts_module

    embedding = model.get_input_embeddings()
    out = embedding(batches[rank])
    capturing, token_counts_module._capturing = token_counts_module._capturing, lambda: True
    try:
        with pytest.raises(ValueError, match=r"input embedding's gradient\) is being captured in a CUDA graph with "
                                             "different token counts"):  # fmt: skip
            out.sum().backward()
    finally:
        token_counts_module._capturing = capturing


def allgather_dispatcher(rank: int, world_size: int) -> None:
    """``AllGatherExpertParallelDispatcher.run`` with experts that scale each row by a weight of its
    expert (and write NaN into the padding rows, which must not leak): output and the gradients of
    the tokens, routing weights and expert weights equal the local dispatcher's; ranks with different
    token counts (padded) too."""
    from moetune.distributed import AllGatherExpertParallelDispatcher
    from moetune.moe import LocalTokenDispatcher, Routing

    num_experts, hidden, top_k, num_tokens = 8, 4, 2, 9
    num_local = num_experts // world_size
    case = dispatch_case(rank, num_tokens=num_tokens, first_experts_only=4, num_local=num_local)
    gen, weight_EH = case.gen, case.weight_EH

    def scaled_rows(first_expert: int):
        return scaled_rows_experts(weight_EH, first_expert)

    def run(dispatcher, first_expert: int):
        return case.run(dispatcher, scaled_rows(first_expert), num_experts=num_experts)

    expected, expected_grads = run(LocalTokenDispatcher(), 0)
    got, grads = run(AllGatherExpertParallelDispatcher(group=dist.group.WORLD, ep_size=world_size), rank * num_local)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grads[0], expected_grads[0])
    torch.testing.assert_close(grads[1], expected_grads[1])
    # Expert weights: the world average of the local dispatcher's gradients (each rank's rows scaled by 1/ep).
    expert_grads = expected_grads[2].clone()
    dist.all_reduce(expert_grads)
    mine = slice(rank * num_local, (rank + 1) * num_local)
    torch.testing.assert_close(grads[2][mine], expert_grads[mine] / world_size)

    # Different token counts on the ranks (generation, unpacked batches): the shorter rank is padded.
    uneven_tokens = num_tokens + 3 * rank
    x_uneven = torch.randn(uneven_tokens, hidden, generator=gen, requires_grad=True)
    uneven_routing = Routing(
        torch.zeros(uneven_tokens, num_experts),
        torch.rand(uneven_tokens, top_k, generator=gen),
        torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(uneven_tokens)]),
    )
    local = LocalTokenDispatcher().run(x_uneven, uneven_routing, scaled_rows(0), num_experts=num_experts)
    dispatcher = AllGatherExpertParallelDispatcher(group=dist.group.WORLD, ep_size=world_size)
    got = dispatcher.run(x_uneven, uneven_routing, scaled_rows(rank * num_local), num_experts=num_experts)
    assert got.shape == local.shape
    torch.testing.assert_close(got, local)
    probe_uneven = torch.randn(uneven_tokens, hidden, generator=gen)
    torch.testing.assert_close(
        torch.autograd.grad((got * probe_uneven).sum(), x_uneven)[0],
        torch.autograd.grad((local * probe_uneven).sum(), x_uneven)[0],
    )
    # A CUDA-graph capture skips the count exchange: after an uneven eager call it must refuse.
    import pytest

    import moetune.distributed.token_counts as token_counts_module

    capturing, token_counts_module._capturing = token_counts_module._capturing, lambda: True
    try:
        with pytest.raises(ValueError, match=r"ep_dispatch='allgather' .* different token counts"):
            dispatcher.run(x_uneven, uneven_routing, scaled_rows(rank * num_local), num_experts=num_experts)
    finally:
        token_counts_module._capturing = capturing
