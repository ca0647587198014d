"""Bodies of the spawned distributed tests (module level, so ``torch.multiprocessing.spawn`` can pickle them).

Every rank also builds the single-process reference (the tiny model is cheap) from the same
checkpoint and trains it on the concatenation of all ranks' micro-batches.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import moetune
from moetune.distributed import (
    clip_grad_norm_,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
)
from moetune.moe import MoEBlock
from tests.distributed.helpers import (
    MICRO_BATCH,
    SEQ,
    distributed_loss,
    distributed_output,
    gathered,
    global_batch,
    global_loss_value,
    micro_batch,
    read_safetensors,
    reference_loss,
    reference_output,
    rel_err,
)

TOL = 1e-5
SGD_STEPS = 3
LR = 0.5  # large, so that wrong gradients show up in the next steps' losses
# Adam's first update is about lr * sign(g): for gradient entries near zero (contributions that
# cancel) the fp32 summation order of the reduction decides it, so a few entries' updates differ by
# up to ~1e-3 relative. A fine-tuning lr (1e-3) and eps 1e-6 keep the parameters within 1e-5.
ADAM_LR = 1e-3
ADAM_EPS = 1e-6

# The CUDA-graph capturable expert-parallel setting (tests/distributed/replicate_workers.py).
ALLGATHER_REPLICATE = {"ep_dispatch": "allgather", "dense_parallel": "replicate"}


def _load(folder: str, **kwargs):
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    model.train()
    return model


def _check_layout(
    model, world_size: int, ep: int, *, dispatcher: str = "ExpertParallelDispatcher", replicated: bool = False,
    vocab_parallel: bool = False,
) -> None:
    """Experts are sharded over ep; everything else FSDP2-sharded (or, ``replicated``, full plain tensors,
    but for the embedding and LM head with ``vocab_parallel``)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert blocks, "no MoE layers"
    for block in blocks:
        weight = block.experts.in_proj
        assert isinstance(weight, DTensor)
        assert weight.to_local().shape[0] * (world_size // ep) * ep >= block.num_experts
        assert type(block.dispatcher).__name__ == (dispatcher if ep > 1 else "LocalTokenDispatcher")
    if replicated:
        expert_params = {id(p) for b in blocks for p in b.experts.parameters()}
        if vocab_parallel:
            expert_params |= {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) == (id(param) in expert_params), f"{name}: wrong placement"
        return
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not sharded"
    # Each rank holds (and read from the checkpoint) about 1 / world of the model.
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert local <= total / world_size * 1.05, (local, total)


def _compare_grads(model, ref, *, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{what}: no gradient for {name}"
        err = rel_err(gathered(param.grad), ref_params[name].grad)
        assert err < TOL, f"{what}: gradient of {name} differs by {err:.2e}"


def _compare_params(model, ref, *, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        err = rel_err(gathered(param.data), ref_params[name].data)
        assert err < TOL, f"{what}: {name} differs by {err:.2e}"


def _step_pair(model, ref, opt, ref_opt, step: int, rank: int, world_size: int, vocab: int, *, what: str) -> float:
    loss = distributed_loss(model, step, rank, world_size, vocab)
    loss.backward()
    expected = reference_loss(ref, step, world_size, vocab)
    expected.backward()
    got = global_loss_value(loss, world_size)
    assert abs(got - expected.item()) <= TOL * abs(expected.item()), f"{what}: loss {got} vs {expected.item()}"
    _compare_grads(model, ref, what=what)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    return got


def train_parity(
    rank: int,
    world_size: int,
    folder: str,
    ep: int,
    out: str,
    check_save: bool = True,
    expect_descent: bool = True,
    **options,
) -> None:
    """``SGD_STEPS`` SGD steps (with clipping) and one AdamW step: losses, gradients and parameters
    equal the single-process run; an EP save equals the single-process save. ``options``: more
    moetune keyword arguments (e.g. ``ep_dispatch``, ``dense_parallel``)."""
    vocab = 64
    model = _load(folder, ep_size=ep, **options)
    ref = _load(folder)
    _check_layout(model, world_size, ep, **_expected_layout(options))
    if check_save:
        _check_save_equal(model, ref, Path(out) / f"ep{ep}", rank)

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(SGD_STEPS):
        loss = distributed_loss(model, step, rank, world_size, vocab)
        loss.backward()
        expected = reference_loss(ref, step, world_size, vocab)
        expected.backward()
        got = global_loss_value(loss, world_size)
        assert abs(got - expected.item()) <= TOL * abs(expected.item()), f"ep={ep} step {step}: loss {got} vs {expected.item()}"
        _compare_grads(model, ref, what=f"ep={ep} step {step}")
        norm = clip_grad_norm_(model, 0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert rel_err(norm, ref_norm) < TOL, f"ep={ep} step {step}: grad norm {norm.item()} vs {ref_norm.item()}"
        _compare_grads(model, ref, what=f"ep={ep} step {step} (clipped)")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(got)
    _compare_params(model, ref, what=f"ep={ep} after {SGD_STEPS} SGD steps")

    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR, weight_decay=0.1, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ADAM_LR, weight_decay=0.1, eps=ADAM_EPS)
    _step_pair(model, ref, opt, ref_opt, SGD_STEPS, rank, world_size, vocab, what=f"ep={ep} AdamW")
    _compare_params(model, ref, what=f"ep={ep} after AdamW")
    if expect_descent:  # a model that starts at the random-token entropy (ln vocab) cannot go lower
        assert losses[-1] < losses[0], f"ep={ep}: the loss does not go down: {losses}"


def _expected_layout(options: dict) -> dict:
    dispatcher = "AllGatherExpertParallelDispatcher" if options.get("ep_dispatch") == "allgather" else "ExpertParallelDispatcher"
    return {
        "dispatcher": dispatcher,
        "replicated": options.get("dense_parallel") == "replicate",
        "vocab_parallel": options.get("vocab_parallel", False),
    }


def _mesh(dp: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.distributed import MESH_DIM_NAMES

    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=MESH_DIM_NAMES)


def _check_save_equal(model, ref, folder: Path, rank: int) -> None:
    """``save_pretrained`` on every rank writes the same Hugging Face checkpoint as one process."""
    model.save_pretrained(folder / "ep", is_main_process=rank == 0)
    if rank == 0:
        ref.save_pretrained(folder / "single")
        _assert_same_checkpoint(folder / "ep", folder / "single")
    dist.barrier()


def _assert_same_checkpoint(got_folder: Path, expected_folder: Path) -> None:
    got, expected = read_safetensors(got_folder), read_safetensors(expected_folder)
    assert sorted(got) == sorted(expected), set(got) ^ set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), f"saved {key} differs"
    assert (got_folder / "config.json").read_text() == (expected_folder / "config.json").read_text()


def save_and_push_on_every_rank(rank: int, world_size: int, folder: str, out: str) -> None:
    """``save_pretrained`` without ``is_main_process`` and ``push_to_hub``, called on every rank of a
    model moetune sharded: global rank 0 alone writes (the single-process checkpoint) and alone talks
    to the Hub (a recording stand-in for ``huggingface_hub.HfApi``: tests have no network)."""
    import shutil

    import huggingface_hub
    import pytest
    from huggingface_hub import RepoUrl

    out_dir = Path(out) / "save-and-push"
    model = _load(folder, ep_size=2)
    model.save_pretrained(out_dir / f"default-rank{rank}")
    calls = []

    class RecordingHfApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create_repo", repo_id))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, **options):
            calls.append(("upload_folder", repo_id, options["commit_message"]))
            shutil.copytree(folder_path, out_dir / "pushed")  # the push's folder is temporary

    real_api, huggingface_hub.HfApi = huggingface_hub.HfApi, RecordingHfApi
    try:
        model.push_to_hub("org/tiny-moe", commit_message="ep=2", token="hf_x")
        with pytest.raises(ValueError, match="does not take \\['tags'\\]"):
            model.push_to_hub("org/tiny-moe", tags=["sft"])  # refused before any collective, on every rank
    finally:
        huggingface_hub.HfApi = real_api
    dist.barrier()
    if rank == 0:
        _load(folder).save_pretrained(out_dir / "single")
        _assert_same_checkpoint(out_dir / "default-rank0", out_dir / "single")
        assert not (out_dir / "default-rank1").exists()
        assert calls == [("init", "hf_x"), ("create_repo", "org/tiny-moe"), ("upload_folder", "org/tiny-moe", "ep=2")]
        _assert_same_checkpoint(out_dir / "pushed", out_dir / "single")
    else:
        assert calls == []
    dist.barrier()


def dcp_resume(
    rank: int, world_size: int, folder: str, ep: int, out: str, optimizer_cls=torch.optim.AdamW, **options
) -> None:
    """Save model + AdamW state with DCP after two steps, load them into a freshly loaded model and
    optimizer: the next step's loss and parameters equal those of the run that kept going."""
    vocab = 64
    model = _load(folder, ep_size=ep, **options)
    opt = optimizer_cls(model.parameters(), lr=1e-2)
    for step in range(2):
        distributed_loss(model, step, rank, world_size, vocab).backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    path = Path(out) / f"dcp-{optimizer_cls.__module__}-{'-'.join(map(str, options.values()))}"
    save_distributed_checkpoint(model, opt, path)
    loss = distributed_loss(model, 2, rank, world_size, vocab)
    loss.backward()
    opt.step()
    next_loss = global_loss_value(loss, world_size)
    after = {n: gathered(p.data).clone() for n, p in model.named_parameters()}

    resumed = _load(folder, ep_size=ep, **options)
    resumed_opt = optimizer_cls(resumed.parameters(), lr=1e-2)
    load_distributed_checkpoint(resumed, resumed_opt, path)
    loss = distributed_loss(resumed, 2, rank, world_size, vocab)
    loss.backward()
    resumed_opt.step()
    got = global_loss_value(loss, world_size)
    assert got == next_loss, f"resumed loss {got} vs {next_loss}"
    for name, param in resumed.named_parameters():
        assert torch.equal(gathered(param.data), after[name]), f"{name} differs after the resumed step"


def one_step_parity(
    rank: int, world_size: int, folder: str, *, what: str, enable_ac: bool = False, prepare=None, **kwargs
) -> None:
    """Loss and gradients of one step equal the single-process ones (``prepare(model)`` first, if given)."""
    vocab = 64
    model, ref = _load(folder, **kwargs), _load(folder)
    if prepare is not None:
        prepare(model)
    if enable_ac:
        model.gradient_checkpointing_enable()
        ref.gradient_checkpointing_enable()
    loss = distributed_loss(model, 0, rank, world_size, vocab)
    loss.backward()
    expected = reference_loss(ref, 0, world_size, vocab)
    expected.backward()
    got = global_loss_value(loss, world_size)
    assert abs(got - expected.item()) <= TOL * abs(expected.item()), f"{what}: loss {got} vs {expected.item()}"
    _compare_grads(model, ref, what=what)


def _forward_in_inference_mode(model) -> None:
    """Under torch.inference_mode, then no_grad: equal logits (FSDP2's gathered buffers must not become
    inference tensors, or the step after fails writing into them)."""
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits)


def recipe_host_sums(rank: int, world_size: int) -> None:
    """The recipe's per-step host numbers are summed over its own gloo group, on the CPU."""
    from moetune.recipe.config import DistributedConfig, TrainingConfig
    from moetune.recipe.distributed_setup import all_reduce_sum, init_runtime

    runtime = init_runtime(TrainingConfig(device="cpu"), DistributedConfig())
    assert runtime.host_group is not None and dist.get_world_size(runtime.host_group) == world_size
    assert all_reduce_sum([rank + 1.0, 0.5], runtime) == [3.0, 1.0]
    default = init_runtime(TrainingConfig(device="cpu"), DistributedConfig(host_gloo_group=False))
    assert default.host_group is None and all_reduce_sum([rank + 1.0], default) == [3.0]


def _refuse_on_rank0() -> int:
    raise ValueError("checkpoint.resume: refused by rank 0")


def recipe_ranks_agree(rank: int, out: str) -> None:
    """The recipe's multi-node checks, on two ranks posing as two nodes: an error found on one rank
    is raised on every rank (none is left waiting in a collective)."""
    import dataclasses

    import pytest

    from moetune.recipe.config import DistributedConfig, TrainingConfig
    from moetune.recipe.distributed_setup import (
        check_same_on_every_rank, check_shared_folder, init_runtime, rank0_decides,
    )

    runtime = dataclasses.replace(init_runtime(TrainingConfig(device="cpu"), DistributedConfig()), nodes=2)
    shared = Path(out) / "shared"
    check_shared_folder(shared, runtime, field="training.output_dir", wait_s=5)
    dist.barrier()
    assert list(shared.iterdir()) == []  # rank 0's marker is gone
    # Node-local folders (each rank its own): refused on both ranks, naming the rank that saw nothing.
    with pytest.raises(ValueError, match=r"training.output_dir: .* is not one folder for all 2 nodes: ranks 1 \("):
        check_shared_folder(Path(out) / f"local{rank}", runtime, field="training.output_dir", wait_s=0.3)
    assert rank0_decides(lambda: 10 + rank, runtime) == 10  # rank 0's answer for all
    with pytest.raises(ValueError, match="^checkpoint.resume: refused by rank 0$"):
        rank0_decides(_refuse_on_rank0, runtime)
    check_same_on_every_rank("same", runtime, what="the data")
    with pytest.raises(ValueError, match=r"^the data differs between the processes \(rank 0: a; rank 1: b\)$"):
        check_same_on_every_rank("ab"[rank], runtime, what="the data")


def two_process_suite(rank: int, world_size: int, folder: str, tied_folder: str, out: str) -> None:
    assert world_size == 2
    recipe_host_sums(rank, world_size)
    recipe_ranks_agree(rank, out)
    # Without ep_size / device_mesh, from_pretrained under torchrun returns an unsharded model.
    plain = _load(folder)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    del plain
    train_parity(rank, world_size, folder, 2, out)
    dcp_resume(rank, world_size, folder, 2, out)
    from moetune.optim import AdamW

    dcp_resume(rank, world_size, folder, 2, out, optimizer_cls=AdamW)  # moetune's optimizer: same state layout
    # Activation checkpointing (Transformers' switch) recomputes the routing and the all-to-alls identically.
    one_step_parity(rank, world_size, folder, what="ep=2 + activation checkpointing", ep_size=2, enable_ac=True)
    # A user's mesh; ep = 1 over it is plain FSDP2 over both ranks.
    one_step_parity(rank, world_size, folder, what="user mesh (2, 1)", device_mesh=_mesh(2, 1))
    mixed_precision_and_from_config(rank, world_size, folder)
    one_step_parity(rank, world_size, folder, what="after an inference_mode forward", ep_size=2,
                    prepare=_forward_in_inference_mode)  # fmt: skip
    from_config_draws_like_one_process(rank, world_size, ep=2)
    from_config_draws_like_one_process(rank, world_size, ep=2, **ALLGATHER_REPLICATE)
    # Capacity-padded dispatch: with factor >= ep nothing is dropped, so it is exact too.
    one_step_parity(rank, world_size, folder, what="ep=2, capacity 2.0", ep_size=2, ep_capacity_factor=2.0)
    dispatchers(rank, world_size)
    pipelined_dispatch(rank, world_size)
    pipelined_parity(rank, world_size, folder, ep=2, chunks=(2, 3))
    from tests.distributed.bucketing_workers import bucketed_dispatch, bucketed_model_parity

    bucketed_dispatch(rank, world_size)
    bucketed_model_parity(rank, world_size, folder)
    generate_parity(rank, world_size, folder)
    compiled_layers_parity(rank, world_size, folder)
    from tests.distributed.inference_workers import generation_gathers_once

    generation_gathers_once(rank, world_size, folder, ep=2)
    rebalanced_experts_parity(rank, world_size, folder)  # FSDP2-sharded router rows: the DTensor path
    optimizer_after_inference_forward(rank, world_size, folder)
    # Tied LM head and embeddings: one parameter, in FSDP2's root group.
    one_step_parity(rank, world_size, tied_folder, what="tied embeddings, ep=2", ep_size=2)
    _check_save_equal(_load(tied_folder, ep_size=2), _load(tied_folder), Path(out) / "tied-save", rank)
    save_and_push_on_every_rank(rank, world_size, folder, out)


def optimizer_after_inference_forward(rank: int, world_size: int, folder: str) -> None:
    """An optimizer built after a forward without gradients (an evaluation) holds the FSDP2-sharded
    parameters, not the root group's temporary gathered ones: AdamW steps then equal one process's."""
    model, ref = _load(folder, ep_size=world_size), _load(folder)
    with torch.no_grad():
        model(input_ids=micro_batch(0, rank, 64)[0])
    assert all(isinstance(p, DTensor) for p in model.parameters()), "the root group stayed gathered"
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=ADAM_LR, eps=ADAM_EPS, foreach=False) for m in (model, ref))
    for step in range(2):
        _step_pair(model, ref, opt, ref_opt, step, rank, world_size, 64, what=f"optimizer after inference, step {step}")


def rebalanced_experts_parity(rank: int, world_size: int, folder: str, *, ep: int | None = None, **options) -> None:
    """Load-balanced expert placement under expert parallelism (ep = world, or ep < world with the
    experts FSDP2-sharded over their replicas): every rank counts the same global loads; the relabelled
    expert-parallel model trains exactly like one process holding the same relabelled model (AdamW
    steps); its ep shards' routed rows are balanced at least as well as the contiguous placement's;
    restoring the order gives back every parameter of the checkpoint."""
    from moetune.distributed.placement import expert_loads, rebalance_experts, restore_expert_order, rows_per_rank

    ep = ep or world_size
    model, ref, fresh = _load(folder, ep_size=ep, **options), _load(folder), _load(folder)
    loads = expert_loads(model, [{"input_ids": micro_batch(0, rank, 64)[0]}])
    ref_loads = expert_loads(ref, [{"input_ids": global_batch(0, world_size, 64)[0]}], all_ranks=False)
    assert loads.keys() == ref_loads.keys() and all(torch.equal(loads[n], ref_loads[n]) for n in loads), "loads differ"
    orders = rebalance_experts(model, loads, num_ranks=ep)
    assert orders == {} or all(torch.equal(orders[n], o) for n, o in rebalance_experts(ref, ref_loads, num_ranks=ep).items())
    for name, order in orders.items():
        blocks = lambda rows: rows_per_rank(rows, ep).max().item()  # noqa: E731
        assert blocks(loads[name][order]) <= blocks(loads[name]), f"{name}: the relabelled blocks are less balanced"
    _compare_params(model, ref, what="relabelled experts")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=ADAM_LR, eps=ADAM_EPS, foreach=False) for m in (model, ref))
    for step in range(2):
        _step_pair(model, ref, opt, ref_opt, step, rank, world_size, 64, what=f"relabelled experts, step {step}")
    restore_expert_order(model)
    restore_expert_order(ref)
    _compare_params(model, ref, what="restored expert order")
    model, ref = _load(folder, ep_size=ep, **options), fresh
    rebalance_experts(model, loads, num_ranks=ep)
    restore_expert_order(model)
    for name, param in model.named_parameters():
        assert torch.equal(gathered(param.data), dict(ref.named_parameters())[name].data), f"{name} not restored"


def dispatchers(rank: int, world_size: int) -> None:
    """The dispatchers alone: round trip through an elementwise 'expert' equals the local dispatcher's;
    the capacity dispatcher asks the host only for the group's token counts (one per eager dispatch);
    a small capacity drops rows, not tokens; ranks with different token counts size their blocks alike."""
    from moetune.distributed import CapacityExpertParallelDispatcher, ExpertParallelDispatcher
    from moetune.moe import LocalTokenDispatcher, Routing

    gen = torch.Generator().manual_seed(rank)
    num_tokens, hidden, num_experts, top_k = 12, 4, 8, 2
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    experts[: num_tokens // 2, 0] = 0  # skew the load towards rank 0's experts
    routing = Routing(torch.zeros(num_tokens, num_experts), torch.rand(num_tokens, top_k, generator=gen), experts)

    def round_trip(dispatcher):
        rows, counts, state = dispatcher.dispatch(x, routing, num_experts=num_experts)
        return dispatcher.combine(rows * 2.0, state), counts

    expected, _ = round_trip(LocalTokenDispatcher())
    group = dist.group.WORLD
    exact, counts = round_trip(ExpertParallelDispatcher(group=group, ep_size=world_size))
    assert int(counts.sum()) > 0
    torch.testing.assert_close(exact, expected)
    grad_exact = torch.autograd.grad(exact.sum(), x)[0]
    torch.testing.assert_close(grad_exact, torch.autograd.grad(expected.sum(), x)[0])

    with host_syncs() as syncs:
        padded, _ = round_trip(CapacityExpertParallelDispatcher(group=group, ep_size=world_size, capacity_factor=2.0))
        dropping, _ = round_trip(CapacityExpertParallelDispatcher(group=group, ep_size=world_size, capacity_factor=0.5))
    assert syncs == ["tolist", "tolist"], f"host syncs in the capacity dispatcher: {syncs}"
    torch.testing.assert_close(padded, expected)
    torch.testing.assert_close(torch.autograd.grad(padded.sum(), x)[0], grad_exact)
    # Rank 0's experts get more than capacity rows from every rank: some (token, expert) pairs drop.
    dropped = (dropping - expected).abs().sum(dim=1) > 1e-6
    flag = dropped.any().float()
    dist.all_reduce(flag)
    assert flag.item() > 0, "capacity 0.5 dropped nothing"

    # Different token counts on the ranks (rank r keeps 12 - 3r tokens): blocks sized from the
    # largest; with capacity_factor = ep nothing drops, so it equals the local dispatcher.
    short = num_tokens - 3 * rank
    x_short = x[:short]
    routing_short = Routing(routing.logits_TE[:short], routing.weights_TK[:short], routing.experts_TK[:short])
    uneven = CapacityExpertParallelDispatcher(group=group, ep_size=world_size, capacity_factor=float(world_size))
    rows, _, state = uneven.dispatch(x_short, routing_short, num_experts=num_experts)
    got = uneven.combine(rows * 2.0, state)
    local = LocalTokenDispatcher()
    rows_local, _, state_local = local.dispatch(x_short, routing_short, num_experts=num_experts)
    torch.testing.assert_close(got, local.combine(rows_local * 2.0, state_local))


@contextlib.contextmanager
def host_syncs():
    """Yields the list of ``.tolist()`` / ``.item()`` calls made inside (each one waits for the device)."""
    calls: list[str] = []
    saved = torch.Tensor.tolist, torch.Tensor.item

    def recording(name: str, original):
        def call(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return call

    torch.Tensor.tolist, torch.Tensor.item = recording("tolist", saved[0]), recording("item", saved[1])
    try:
        yield calls
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved


def pipelined_dispatch(rank: int, world_size: int) -> None:
    """``PipelinedExpertParallelDispatcher.run`` alone, C in {2, 3}, with experts that scale each row by
    a weight of its expert: the output and the gradients of the tokens, the routing weights and the
    expert weights equal ``ExpertParallelDispatcher``'s (output and token gradients also the local
    dispatcher's); one host sync per call, none in backward. 13 tokens (divisible by neither C) whose
    first 7 go to rank 0's experts only (chunk 0 sends no rows to the other ranks, which receive none),
    and 2 tokens (with C = 3: an empty chunk)."""
    from moetune.distributed import ExpertParallelDispatcher, PipelinedExpertParallelDispatcher
    from moetune.moe import LocalTokenDispatcher, Routing

    num_experts, hidden, top_k = 8, 4, 2
    num_local = num_experts // world_size
    weight_EH = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    gen = torch.Generator().manual_seed(10 + rank)

    def scaled_rows(first_expert: int):
        def experts(x_MH, counts_L):
            if x_MH.shape[0] == 0:  # like GroupedExperts: an output that ignores the (no) rows
                return x_MH.new_zeros(0, hidden) + 0 * weight_EH.sum()
            local_M = torch.repeat_interleave(torch.arange(counts_L.numel()), counts_L, output_size=x_MH.shape[0])
            return x_MH * weight_EH[first_expert + local_M]

        return experts

    def run(dispatcher, first_expert: int, x, routing, probe):
        out = dispatcher.run(x, routing, scaled_rows(first_expert), num_experts=num_experts)
        return out, torch.autograd.grad((out * probe).sum(), [x, routing.weights_TK, weight_EH])

    group = dist.group.WORLD
    for num_tokens in (13, 2):
        x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
        experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        experts[:7] = torch.stack([torch.randperm(num_local, generator=gen)[:top_k] for _ in experts[:7]])
        weights = torch.rand(num_tokens, top_k, generator=gen, requires_grad=True)
        routing = Routing(torch.zeros(num_tokens, num_experts), weights, experts)
        probe = torch.randn(num_tokens, hidden, generator=gen)
        local_out, (local_dx, local_dw, _) = run(LocalTokenDispatcher(), 0, x, routing, probe)
        exact = ExpertParallelDispatcher(group=group, ep_size=world_size)
        ep_out, ep_grads = run(exact, rank * num_local, x, routing, probe)
        for chunks in (2, 3):
            pipelined = PipelinedExpertParallelDispatcher(group=group, ep_size=world_size, num_chunks=chunks)
            with host_syncs() as syncs:
                out = pipelined.run(x, routing, scaled_rows(rank * num_local), num_experts=num_experts)
                assert syncs == ["tolist"], f"{chunks} chunks: host syncs in forward {syncs}"
                grads = torch.autograd.grad((out * probe).sum(), [x, routing.weights_TK, weight_EH])
                assert syncs == ["tolist"], f"{chunks} chunks: host syncs in backward {syncs[1:]}"
            torch.testing.assert_close(out, ep_out)
            torch.testing.assert_close(out, local_out)
            for got, expected in zip(grads, ep_grads):
                torch.testing.assert_close(got, expected)
            torch.testing.assert_close(grads[0], local_dx)
            torch.testing.assert_close(grads[1], local_dw)


def pipelined_parity(rank: int, world_size: int, folder: str, *, ep: int, chunks: tuple[int, ...]) -> None:
    """``ep_overlap_chunks``: loss, logits and every gradient equal ``ExpertParallelDispatcher``'s and one
    process's (fp32, 1e-5), for each C in ``chunks``, on 20 tokens per rank (not divisible by 3) and on 6
    (chunks of two or three tokens, of which some send no rows to some rank: checked)."""
    from moetune.distributed import ExpertParallelDispatcher, PipelinedExpertParallelDispatcher
    from moetune.distributed.pipelined_dispatcher import chunk_of_tokens

    vocab = 64
    model, ref = _load(folder, ep_size=ep, ep_overlap_chunks=chunks[0]), _load(folder)
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    loaded = blocks[0].dispatcher
    assert isinstance(loaded, PipelinedExpertParallelDispatcher) and loaded.num_chunks == chunks[0], loaded
    dispatchers = {"ExpertParallelDispatcher": ExpertParallelDispatcher(group=loaded.group, ep_size=ep)}
    for c in chunks:
        dispatchers[f"ep_overlap_chunks={c}"] = PipelinedExpertParallelDispatcher(
            group=loaded.group, ep_size=ep, num_chunks=c
        )
    routings = []
    hooks = [block.gate.register_forward_hook(lambda _m, _i, routing: routings.append(routing)) for block in blocks]
    for seq in (SEQ, 3):
        expected = reference_output(ref, 0, world_size, vocab, seq=seq, return_logits=True)
        expected.loss.backward()
        expected_logits = expected.logits[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
        baseline = None
        for name, dispatcher in dispatchers.items():
            what = f"ep={ep}, {name}, {MICRO_BATCH * seq} tokens per rank"
            for block in blocks:
                block.dispatcher = dispatcher
            out = distributed_output(model, 0, rank, world_size, vocab, seq=seq, return_logits=True)
            out.loss.backward()
            loss = global_loss_value(out.loss, world_size)
            assert abs(loss - expected.loss.item()) <= TOL * abs(expected.loss.item()), f"{what}: loss {loss}"
            assert rel_err(out.logits, expected_logits) < TOL, f"{what}: logits differ"
            _compare_grads(model, ref, what=what)
            grads = {n: gathered(p.grad).clone() for n, p in model.named_parameters()}
            if baseline is None:
                baseline = loss, out.logits.detach(), grads
            else:
                assert abs(loss - baseline[0]) <= TOL * abs(baseline[0]), f"{what}: loss {loss} vs {baseline[0]}"
                assert rel_err(out.logits, baseline[1]) < TOL, f"{what}: logits differ from ExpertParallelDispatcher's"
                for param_name, grad in grads.items():
                    err = rel_err(grad, baseline[2][param_name])
                    assert err < TOL, f"{what}: gradient of {param_name} differs from EP's by {err:.2e}"
            model.zero_grad()
        ref.zero_grad()
    for hook in hooks:
        hook.remove()
    # The last forward (6 tokens, the largest C): some chunk sent no rows to some rank.
    num_local, last = blocks[0].num_experts // ep, routings[-len(blocks) :]
    skipped = 0
    for routing in last:
        chunk_T = chunk_of_tokens(routing.experts_TK.shape[0], chunks[-1], device=torch.device("cpu"))
        for c in chunk_T.unique().tolist():
            skipped += len(set((routing.experts_TK[chunk_T == c] // num_local).flatten().tolist())) < ep
    flag = torch.tensor(float(skipped))
    dist.all_reduce(flag)
    assert flag.item() > 0, "no chunk sent zero rows to a rank: the case is not exercised"


def mixed_precision_and_from_config(rank: int, world_size: int, folder: str) -> None:
    """bf16 compute over fp32 weights (FSDP2 MixedPrecisionPolicy) stays close to fp32; from_config
    under EP initialises the sharded weights with Transformers' scheme."""
    vocab = 64
    model = _load(folder, ep_size=2, param_dtype=torch.bfloat16, reduce_dtype="float32")
    ref = _load(folder)
    loss = distributed_loss(model, 0, rank, world_size, vocab)
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    expected = reference_loss(ref, 0, world_size, vocab).item()
    got = global_loss_value(loss, world_size)
    assert abs(got - expected) < 2e-2 * abs(expected), f"bf16 compute: loss {got} vs {expected}"

    from tests.conftest import tiny_qwen3_moe_config

    config = tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False)
    torch.manual_seed(0)
    fresh = moetune.AutoModelForCausalLM.from_config(config, ep_size=2)
    _check_layout(fresh, world_size, 2)
    std = config.initializer_range
    for name, param in fresh.named_parameters():
        full = gathered(param.data)
        assert torch.isfinite(full).all(), name
        if name.endswith(("gate_up_proj", "down_proj", "q_proj.weight", "gate.weight")):
            assert 0.5 * std < full.std().item() < 1.5 * std, f"{name}: std {full.std().item()}"
    fresh.train()
    distributed_loss(fresh, 0, rank, world_size, vocab).backward()


def _meta_initialised(config):
    """One process's ``init_weights`` after building on the meta device (the order the sharded
    path draws in), seed 0."""
    from moetune.utils.materialize import materialize
    from moetune.models.registry import family_for

    family = family_for(config)
    with torch.device("meta"):
        model = family.causal_lm._from_config(config, attn_implementation=family.default_attention)
    materialize(model, "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def from_config_draws_like_one_process(rank: int, world_size: int, *, ep: int, families=None, **options) -> None:
    """``from_config`` under EP / FSDP2 with the same seed on every rank (``transformers.set_seed``):
    each shard is its part of the full tensors one process draws (no shard repeats another, as each
    rank drawing its local shard from its own generator gave), for every family; Nemotron-H's
    ``init.copy_`` of plain tensors into its sharded Mamba-2 parameters works."""
    from tests.conftest import tiny_qwen3_moe_config
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    configs = {"qwen3_moe": lambda: tiny_qwen3_moe_config(vocab_size=64), "deepseek_v3": tiny_deepseek_v3_config,
               "gpt_oss": tiny_gpt_oss_config, "nemotron_h": tiny_nemotron_h_config}  # fmt: skip
    for name in families or configs:
        torch.manual_seed(0)
        model = moetune.AutoModelForCausalLM.from_config(configs[name](), ep_size=ep, **options)
        expected = dict(_meta_initialised(configs[name]()).named_parameters())
        for param_name, param in model.named_parameters():
            assert torch.equal(gathered(param.data), expected[param_name].data), f"{name} {options}: {param_name}"
        down = next(p for n, p in model.named_parameters() if n.endswith("experts.down_proj"))
        experts = gathered(down.data)
        assert not torch.equal(experts[0], experts[experts.shape[0] // 2]), f"{name}: expert shards repeat"


def four_process_suite(rank: int, world_size: int, folder: str, two_experts_folder: str, out: str) -> None:
    assert world_size == 4
    from_config_draws_like_one_process(rank, world_size, ep=2, families=["qwen3_moe", "nemotron_h"])  # ep 2 x dp 2
    train_parity(rank, world_size, folder, 4, out)
    train_parity(rank, world_size, folder, 2, out)  # ep 2 x dp_shard_mod_ep 2
    one_step_parity(
        rank, world_size, folder, what="ep=2 x 2, AC, no reshard", ep_size=2, enable_ac=True, reshard_after_forward=False
    )
    # One expert per ep rank and two ranks to shard it over: FSDP2 shards experts on dim 1.
    model = _load(two_experts_folder, ep_size=2)
    placements = [m.experts.gate_up_proj.placements for m in model.modules() if isinstance(m, MoEBlock)]
    assert all(p[0].dim == 1 for p in placements), placements
    del model
    one_step_parity(rank, world_size, two_experts_folder, what="2 experts, ep=2 x dp 2 (Shard(1))", ep_size=2)
    _check_save_equal(_load(two_experts_folder, ep_size=2), _load(two_experts_folder), Path(out) / "two", rank)
    # The capturable path with two replicas of each expert group: experts replicated, not FSDP2-sharded.
    from tests.distributed.replicate_workers import (
        check_replicas_equal_after_from_config,
        overlapped_optimizer_replicated,
    )

    train_parity(rank, world_size, folder, 2, out, **ALLGATHER_REPLICATE)
    dcp_resume(rank, world_size, folder, 2, out, **ALLGATHER_REPLICATE)
    check_replicas_equal_after_from_config(rank, world_size, ep=2)
    overlapped_optimizer_replicated(rank, world_size, folder, ep=2)
    # The vocabulary split over all four ranks while the experts are replicated over two.
    train_parity(rank, world_size, folder, 2, out, **ALLGATHER_REPLICATE, vocab_parallel=True)
    from tests.distributed.lora_workers import merged_lora_export

    merged_lora_export(rank, world_size, folder, out, ep=2)  # experts FSDP2-wrapped over 2 replicas
    from tests.distributed.inference_workers import generation_gathers_once

    generation_gathers_once(rank, world_size, folder, ep=2)  # the experts' FSDP2 groups gathered too
    merged_lora_export(rank, world_size, folder, out, ep=2, **ALLGATHER_REPLICATE)
    rebalanced_experts_parity(rank, world_size, folder, ep=2)  # experts FSDP2-sharded over 2 replicas
    pipelined_dispatch(rank, world_size)
    pipelined_parity(rank, world_size, folder, ep=4, chunks=(3,))
    pipelined_parity(rank, world_size, folder, ep=2, chunks=(3,))  # experts FSDP2-sharded over dp 2: called per chunk


def compiled_layers_parity(rank: int, world_size: int, folder: str) -> None:
    """``torch.compile`` of each decoder layer of an expert-parallel model (the experts run eagerly
    inside, a graph break: dynamo does not trace their DTensor unwrap): one step equals one process,
    for the all-to-all, capacity (no host sync: traced whole around the experts) and all-gather
    dispatchers. ``aot_eager`` traces with dynamo and AOTAutograd, as inductor would, without
    generating code."""
    for options in ({}, {"ep_capacity_factor": 2.0}, ALLGATHER_REPLICATE):
        model, ref = _load(folder, ep_size=2, **options), _load(folder)
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        loss = distributed_loss(model, 0, rank, world_size, 64)
        loss.backward()
        expected = reference_loss(ref, 0, world_size, 64)
        expected.backward()
        got = global_loss_value(loss, world_size)
        assert abs(got - expected.item()) <= TOL * abs(expected.item()), f"compiled layers {options}: loss {got}"
        _compare_grads(model, ref, what=f"compiled layers {options}")


def other_architectures(rank: int, world_size: int, folders: list[tuple[str, str]]) -> None:
    for name, folder in folders:
        one_step_parity(rank, world_size, folder, what=f"{name}, ep=2", ep_size=2)
        one_step_parity(rank, world_size, folder, what=f"{name}, ep=2, all-gather + replicate + vocab_parallel",
                        ep_size=2, **ALLGATHER_REPLICATE, vocab_parallel=True)  # fmt: skip


def global_aux_loss(rank: int, world_size: int, folders: list[tuple[str, str]]) -> None:
    import pytest

    for name, folder in folders:
        one_step_parity(rank, world_size, folder, what=f"{name}, global aux loss", ep_size=2, global_aux_loss=True)
        one_step_parity(rank, world_size, folder, what=f"{name}, global aux loss, all-gather + replicate",
                        ep_size=2, global_aux_loss=True, **ALLGATHER_REPLICATE)  # fmt: skip
        with pytest.raises(AssertionError, match="loss"):  # rank-local aux losses: not the whole batch's
            one_step_parity(rank, world_size, folder, what=f"{name}, rank-local aux loss", ep_size=2)


def bad_inputs(rank: int, world_size: int, folder: str) -> None:
    """Each mistake is a ValueError raised before any parameter is allocated."""
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moetune.distributed import parallelize_for_options
    from moetune.options import MoetuneOptions
    from tests.conftest import tiny_qwen3_moe_config

    cases = {
        "must divide the world size": ({}, dict(ep_size=4)),
        "must divide the number of experts": ({"num_experts": 3, "num_experts_per_tok": 1}, dict(ep_size=2)),
        "needs a mixture-of-experts model": ({"mlp_only_layers": [0, 1, 2]}, dict(ep_size=2)),
        "expected a 2-D mesh": ({}, dict(device_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))),
        "disagrees with the device_mesh": ({}, dict(ep_size=2, device_mesh=_mesh(2, 1))),
        "must be a torch.distributed.device_mesh.DeviceMesh": ({}, dict(device_mesh="2x1")),
        "averages replicated gradients between two CUDA ranks": (
            {}, dict(ep_size=2, ep_dispatch="allgather", dense_parallel="replicate", replicate_transport="copy_engine")
        ),
    }
    allocated = []
    original_to_empty = torch.nn.Module.to_empty

    def spy(self, *args, **kwargs):
        allocated.append(type(self).__name__)
        return original_to_empty(self, *args, **kwargs)

    torch.nn.Module.to_empty = spy
    try:
        for match, (overrides, kwargs) in cases.items():
            config = tiny_qwen3_moe_config(vocab_size=64, **overrides)
            with pytest.raises(ValueError, match=match):
                moetune.AutoModelForCausalLM.from_config(config, **kwargs)
        assert not allocated, f"a bad input was caught only after allocation: {allocated}"
    finally:
        torch.nn.Module.to_empty = original_to_empty

    from moetune.distributed.mesh import check_backend

    with pytest.raises(ValueError, match="needs the NCCL backend"):
        check_backend(torch.device("cuda", 0))  # a CUDA run on a gloo process group

    model = _load(folder, ep_size=2)
    with pytest.raises(ValueError, match="already sharded"):
        parallelize_for_options(model, MoetuneOptions(ep_size=2), init_weights=False)
    with pytest.raises((ValueError, AssertionError, RuntimeError)):
        fully_shard(model)  # FSDP2 refuses to shard a module twice
    with pytest.raises(ValueError, match="already sharded by moetune"):
        torch.nn.parallel.DistributedDataParallel(model)
    replicated = _load(folder, ep_size=2, **ALLGATHER_REPLICATE)  # the same clear error, not a DTensor one
    with pytest.raises(ValueError, match="already sharded by moetune"):
        torch.nn.parallel.DistributedDataParallel(replicated)
    # An unsharded model of the same (moetune) class still wraps in DDP.
    torch.nn.parallel.DistributedDataParallel(_load(folder))
    # Transformers' resize fails deep inside DTensor on FSDP2-sharded embeddings: a clear error instead.
    with pytest.raises(ValueError, match="resize the vocabulary before sharding"):
        model.resize_token_embeddings(72)


def generate_parity(rank: int, world_size: int, folder: str) -> None:
    """Greedy generation under EP (every rank in lockstep: synced_gpus) equals one process's."""
    model, ref = _load(folder, ep_size=2).eval(), _load(folder).eval()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    got = model.generate(ids, max_new_tokens=4, do_sample=False, synced_gpus=True)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False)), "generate differs under EP"


def lora_under_expert_parallelism(rank: int, world_size: int, checkpoint: str) -> None:
    """``from_pretrained(ep_size=2, lora=...)``: adapters added between EP and FSDP2, initialised
    (B = 0, so the loss equals the base model's), only adapters get gradients and change."""
    from moetune.lora import LoraSettings
    from moetune.lora.apply import is_lora_param_name

    settings = LoraSettings(rank=2, alpha=4, target_modules=["q_proj", "v_proj"], target_experts=True)
    base = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, ep_size=world_size)
    model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, ep_size=world_size, lora=settings)
    base.train()
    model.train()
    lora_names = {n for n, _ in model.named_parameters() if is_lora_param_name(n)}
    assert any("experts" in n for n in lora_names) and any("q_proj" in n for n in lora_names)
    assert all(p.requires_grad == (n in lora_names) for n, p in model.named_parameters())
    loss = distributed_loss(model, 0, rank, world_size, model.config.vocab_size)
    expected = distributed_loss(base, 0, rank, world_size, base.config.vocab_size)
    assert rel_err(loss.detach(), expected.detach()) < TOL
    loss.backward()
    before = {n: gathered(p.detach()).clone() for n, p in model.named_parameters()}
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
    for name, param in model.named_parameters():
        changed = not torch.equal(gathered(param.detach()), before[name])
        # B starts at zero, so A gets no gradient on the first step; every B must move.
        if name in lora_names and "lora_B" in name:
            assert changed, name
        if name not in lora_names:
            assert not changed, name


def trainer_suite(rank: int, world_size: int, folder: str, out: str) -> None:
    """``moetune.Trainer`` trains expert-parallel models (all-to-all + FSDP2, all-gather + replicated)
    exactly as Transformers' ``Trainer`` trains the unsharded model with DDP: the same losses, final
    weights (clipping on) and evaluation loss; gradient accumulation; ``save_model`` writes a checkpoint plain Transformers loads; a run resumed
    from an intermediate checkpoint repeats the uninterrupted run's last steps."""
    import transformers

    from moetune import Trainer
    from moetune.optim import AdamW

    rows = torch.randint(0, 64, (16, SEQ), generator=torch.Generator().manual_seed(3))
    dataset = [{"input_ids": row, "labels": row.clone()} for row in rows]

    def train(model, trainer_cls, output_dir, *, save_steps=None, resume=None, accumulate=1):
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), per_device_train_batch_size=2 // accumulate, gradient_accumulation_steps=accumulate,
            max_steps=4, learning_rate=1e-2,
            lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, report_to=[], use_cpu=True, seed=0,
            ddp_backend="gloo", save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        )  # fmt: skip
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:6])
        trainer.train(resume_from_checkpoint=resume)
        return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    reference, expected = train(_load(folder), transformers.Trainer, Path(out) / "ddp")
    expected_eval = reference.evaluate()["eval_loss"]
    reference_params = dict(reference.model.named_parameters())
    for index, options in enumerate(({}, ALLGATHER_REPLICATE)):
        what = f"moetune.Trainer {options or 'alltoall + fsdp'}"
        run_dir = Path(out) / f"ep{index}"
        trainer, losses = train(_load(folder, ep_size=world_size, **options), Trainer, run_dir, save_steps=2)
        assert len(losses) == 4 and all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, expected)), (what, losses, expected)
        for name, param in trainer.model.named_parameters():
            assert rel_err(gathered(param.detach()), reference_params[name].detach()) < 10 * TOL, f"{what}: {name}"
        assert abs(trainer.evaluate()["eval_loss"] - expected_eval) <= TOL * expected_eval, what
        # Transformers' default torch AdamW was swapped for moetune's (same update: the losses above).
        assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), AdamW), what
        trainer.save_model(str(run_dir / "final"))
        dist.barrier()
        plain = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
        for name, param in plain.named_parameters():
            assert rel_err(param.detach(), reference_params[name].detach()) < 10 * TOL, f"{what}: saved {name}"
        _, resumed = train(
            _load(folder, ep_size=world_size, **options), Trainer, run_dir, resume=str(run_dir / "checkpoint-2")
        )
        assert len(resumed) == 4 and all(abs(a - b) <= TOL * abs(b) for a, b in zip(resumed[-2:], losses[-2:])), (what, resumed, losses)
    # Gradient accumulation (2 micro-batches of 1 per step): still Transformers' Trainer + DDP.
    _, expected = train(_load(folder), transformers.Trainer, Path(out) / "ddp_accumulate", accumulate=2)
    _, losses = train(_load(folder, ep_size=world_size, **ALLGATHER_REPLICATE), Trainer, Path(out) / "ep_accumulate", accumulate=2)
    assert len(losses) == 4 and all(abs(a - b) <= TOL * abs(b) for a, b in zip(losses, expected)), ("accumulation", losses, expected)
