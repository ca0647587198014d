"""Workers of the vocabulary-parallel tests (``vocab_parallel=True``: embedding and LM head split by
vocabulary rows over the ranks of a replicated expert-parallel model), run in spawned gloo processes
by tests/distributed/test_expert_parallel.py, each rank comparing against one process."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from tests.distributed.helpers import (
    SEQ,
    distributed_output,
    micro_batch,
    reference_output,
    rel_err,
)
from tests.distributed.replicate_workers import overlapped_optimizer_replicated
from tests.distributed.workers import (
    ALLGATHER_REPLICATE,
    TOL,
    _compare_grads,
    _load,
    dcp_resume,
    one_step_parity,
    train_parity,
)

VOCAB_PARALLEL = {**ALLGATHER_REPLICATE, "vocab_parallel": True}


def vocab_parallel_suite(rank: int, world_size: int, folder: str, tied_folder: str, uneven_folder: str, out: str) -> None:
    """Layout; one step (with and without activation checkpointing), SGD + clipping + AdamW training
    and the saved checkpoint, DCP resume and overlapped AdamW equal one process; the logits path
    (``return_logits``, Transformers' loss on them, generation); tied embeddings; a vocabulary that
    does not split evenly; ranks with different sequence lengths; a refused resize."""
    check_layout(rank, world_size, folder)
    one_step_parity(rank, world_size, folder, what="vocab_parallel", ep_size=world_size, **VOCAB_PARALLEL)
    one_step_parity(
        rank, world_size, folder, what="vocab_parallel + AC", ep_size=world_size, enable_ac=True, **VOCAB_PARALLEL
    )
    train_parity(rank, world_size, folder, world_size, out, **VOCAB_PARALLEL)
    dcp_resume(rank, world_size, folder, world_size, out, **VOCAB_PARALLEL)
    overlapped_optimizer_replicated(rank, world_size, folder, options=VOCAB_PARALLEL)
    logits_parity(rank, world_size, folder)
    one_step_parity(rank, world_size, tied_folder, what="vocab_parallel, tied", ep_size=world_size, **VOCAB_PARALLEL)
    one_step_parity(rank, world_size, uneven_folder, what="vocab_parallel, 65 rows", ep_size=world_size, **VOCAB_PARALLEL)
    uneven_sequences(rank, world_size, folder)
    loss_in_chunks_and_under_autocast(rank, world_size, folder)
    model = _load(folder, ep_size=world_size, **VOCAB_PARALLEL)
    with pytest.raises(ValueError, match="resize_token_embeddings on a vocab_parallel model"):
        model.resize_token_embeddings(72)


def check_layout(rank: int, world_size: int, folder: str) -> None:
    """Both matrices are DTensors Shard(0) over all ranks, rank r holding rows [r * V / world, ...);
    neither is in the replicated gradients' all-reduce."""
    model, ref = _load(folder, ep_size=world_size, **VOCAB_PARALLEL), _load(folder)
    for module, ref_module in ((model.get_input_embeddings(), ref.get_input_embeddings()),
                               (model.get_output_embeddings(), ref.get_output_embeddings())):  # fmt: skip
        weight = module.weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), type(module).__name__
        rows = weight.shape[0] // world_size
        assert torch.equal(weight.to_local(), ref_module.weight[rank * rows : (rank + 1) * rows].detach())
        assert not any(sync.reduces(weight) for sync in model.replicated_gradient_syncs)


def logits_parity(rank: int, world_size: int, folder: str) -> None:
    """``return_logits=True``: every rank gets the full-vocabulary logits of its own tokens, and
    Transformers' loss on them trains the split head (logits' gradients all-to-all'd back); greedy
    generation equals one process's."""
    vocab = 64
    model, ref = _load(folder, ep_size=world_size, **VOCAB_PARALLEL), _load(folder)
    out = distributed_output(model, 0, rank, world_size, vocab, return_logits=True)
    expected = reference_output(ref, 0, world_size, vocab, return_logits=True)
    rows = slice(rank * out.logits.shape[0], (rank + 1) * out.logits.shape[0])
    assert out.logits.shape[-1] == vocab
    err = rel_err(out.logits, expected.logits[rows])
    assert err < TOL, f"vocab_parallel logits differ by {err:.2e}"
    out.loss.backward()
    expected.loss.backward()
    _compare_grads(model, ref, what="vocab_parallel, Transformers' loss on the gathered logits")
    model.eval()
    ref.eval()
    ids, _ = micro_batch(5, rank, vocab)
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        generated = model.generate(ids, **settings)
        expected_ids = ref.generate(ids, **settings)
    assert torch.equal(generated, expected_ids), "vocab_parallel greedy generation differs from one process"


def uneven_sequences(rank: int, world_size: int, folder: str) -> None:
    """Ranks with different sequence lengths (eager): the embedding, the loss and the logits pad the
    shorter ranks; the gradients are still the average of the ranks' gradients."""
    model, ref = _load(folder, ep_size=world_size, **VOCAB_PARALLEL), _load(folder)
    batches = [torch.randint(0, 64, (1, SEQ + 3 * r), generator=torch.Generator().manual_seed(7 + r)) for r in range(world_size)]
    model(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    sum(ref(input_ids=ids, labels=ids).loss for ids in batches).div(world_size).backward()
    _compare_grads(model, ref, what="vocab_parallel, sequence lengths differ between ranks")
    with torch.no_grad():
        logits = model(input_ids=batches[rank], return_logits=True).logits
        expected = ref(input_ids=batches[rank], return_logits=True).logits
    err = rel_err(logits, expected)
    assert err < TOL, f"vocab_parallel logits with uneven sequence lengths differ by {err:.2e}"


def loss_in_chunks_and_under_autocast(rank: int, world_size: int, folder: str) -> None:
    """The split loss over several chunks equals the replicated fused loss on the whole head (fp32),
    and under bf16 autocast with fp32 weights (the recipe's default precision on GPU) it runs its
    GEMMs in bf16 as the replicated loss does and returns fp32 gradients."""
    import contextlib

    import torch.distributed as dist

    from moetune.layers import linear_cross_entropy, lm_head_cross_entropy

    head_module = _load(folder, ep_size=world_size, **VOCAB_PARALLEL).get_output_embeddings()
    head = head_module.weight
    full = head.full_tensor().detach()
    generator = torch.Generator().manual_seed(11)
    hidden = [torch.randn(13, full.shape[1], generator=generator) for _ in range(world_size)]
    targets = [torch.randint(0, full.shape[0], (13,), generator=generator) for _ in range(world_size)]
    targets[rank][: rank + 1] = -100
    try:  # the split weight alone is refused by name: only the head module knows its shard
        linear_cross_entropy(hidden[rank], head, targets[rank])
    except TypeError as error:
        assert "lm_head_cross_entropy" in str(error), error
    else:
        raise AssertionError("linear_cross_entropy accepted a vocabulary-parallel DTensor weight")
    for autocast, tol in ((False, TOL), (True, 2e-2)):
        context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        h, h_ref = (hidden[rank].clone().requires_grad_() for _ in range(2))
        w_ref = full.clone().requires_grad_()
        head.grad = None
        with context:
            loss = lm_head_cross_entropy(head_module, h, targets[rank], chunk_rows=4)  # 7 chunks of the 26 gathered rows
            expected = linear_cross_entropy(h_ref, w_ref, targets[rank], chunk_rows=5)
        loss.backward()
        expected.backward()
        # The split head's gradient is the average over the ranks, as the replicated all-reduce gives.
        dist.all_reduce(w_ref.grad)
        w_ref.grad /= world_size
        assert head.grad.to_local().dtype == torch.float32 and h.grad.dtype == torch.float32
        for got, want, what in ((loss, expected, "loss"), (h.grad, h_ref.grad, "hidden gradient"),
                                (head.grad.full_tensor(), w_ref.grad, "head gradient")):  # fmt: skip
            err = rel_err(got, want)
            assert err < tol, f"vocab_parallel loss in chunks, autocast={autocast}: {what} differs by {err:.2e}"
