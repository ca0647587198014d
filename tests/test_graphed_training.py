"""The decoder stack's training forward / backward replayed from CUDA graphs under the user's own loop
(``moetune.training.graphed_backbone``): the bucket padding is exact (CPU, eager padded path), and
on a GPU the replays train exactly like the eager model (write / accumulate gradients, several
buckets, padding-free batches, PEFT's LoRA, user-owned gradients, two forwards before a backward)."""

from __future__ import annotations

import copy

import pytest
import torch

import moetune
from moetune.layers.document_attention import document_offsets
from moetune.training.graphed_backbone import TrainingGraphs, bucket_count, bucket_length, set_training_graphs
from tests.conftest import rel_err, tiny_family_config, tiny_qwen3_moe_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_buckets_pad_at_most_an_eighth_above_2048():
    assert [bucket_length(n) for n in (1, 256, 257, 2048, 2049, 3000, 4096, 4097, 12000)] == [
        256, 256, 512, 2048, 2304, 3072, 4096, 4608, 12288,
    ]  # fmt: skip
    for n in range(2049, 40000, 37):
        assert n <= bucket_length(n) <= n * 1.125
    assert [bucket_count(n) for n in (1, 8, 9, 100)] == [8, 8, 16, 128]


def _eager_padded_pair(config):
    """(reference model, the same model whose stack runs every batch through the bucket padding)."""
    torch.manual_seed(0)
    reference = moetune.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    padded = copy.deepcopy(reference)
    padded.model.__dict__["_training_graphs"] = runner = TrainingGraphs(padded.model, use_graphs=False)
    return reference, padded, runner


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_right_padded_batches_padded_to_the_bucket_train_exactly(family, monkeypatch):
    """Right-padded rows (labels -100 at the pads) without their mask, padded further: same loss, aux
    loss and gradients as Transformers' masked path (Nemotron-H: also through its Mamba-2 scans)."""
    config = tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_family_config(family)
    config.output_router_logits = True
    reference, padded, runner = _eager_padded_pair(config)
    from moetune.training import graphed_backbone

    planned = []
    monkeypatch.setattr(graphed_backbone, "plan_batch", _spy(graphed_backbone.plan_batch, planned))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 37), generator=generator)
    mask = (torch.arange(37) < torch.tensor([37, 20, 5])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    ours, theirs = (m(input_ids=ids, attention_mask=mask, labels=labels) for m in (padded, reference))
    assert planned and planned[0] is not None and planned[0].padded > 37, "the padded path did not run"
    # ... and produced the outputs (a config's use_cache=True once sent every batch back to the eager path).
    assert config.use_cache and runner.eager_reason is None, runner.eager_reason
    assert rel_err(ours.loss, theirs.loss) < 1e-6
    if theirs.aux_loss is not None:
        assert rel_err(ours.aux_loss, theirs.aux_loss) < 1e-6
    ours.loss.backward()
    theirs.loss.backward()
    for (name, mine), ref in zip(padded.named_parameters(), reference.parameters()):
        if ref.grad is not None:
            assert rel_err(mine.grad, ref.grad) < 1e-5, name


def test_padding_free_batches_get_a_document_of_pads():
    reference, padded, runner = _eager_padded_pair(tiny_qwen3_moe_config())
    lengths = [20, 25, 5]
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    offsets = document_offsets([lengths], row_length=50)
    labels = ids.masked_fill(positions == 0, -100)
    # The key offsets a copy of the query offsets' (a Trainer moves each input to the GPU on its own).
    batch = dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets.clone(),
                 max_length_q=25, max_length_k=25, labels=labels)  # fmt: skip
    assert rel_err(padded(**batch).loss, reference(**batch).loss) < 1e-6
    assert runner.eager_reason is None, runner.eager_reason
    padded(**{**batch, "cu_seq_lens_k": offsets[:-1]})  # other key documents: not self-attention over these
    assert runner.eager_reason is not None and "padding would not be exact" in runner.eager_reason


def test_packed_positions_without_offsets_train_as_documents(monkeypatch):
    """TRL's packing under SDPA passes position_ids that restart at 0 per document and no offsets:
    the graphs' plan finds the documents there (Transformers' masks find the same ones), and the
    loss, aux loss and gradients equal Transformers' block-masked path. Positions that do not
    count up from 0 inside a document run as before."""
    config = tiny_qwen3_moe_config()
    config.output_router_logits = True
    reference, padded, runner = _eager_padded_pair(config)
    from moetune.training import graphed_backbone

    plans = []
    monkeypatch.setattr(graphed_backbone, "plan_batch", _spy(graphed_backbone.plan_batch, plans))
    lengths = [20, 25, 5]
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)
    ours, theirs = (m(input_ids=ids, position_ids=positions, labels=labels) for m in (padded, reference))
    plan = plans[0]
    assert plan is not None and plan.key[0] == "documents" and runner.eager_reason is None, runner.eager_reason
    assert plan.tensors["cu_seq_lens_q"][:4].tolist() == [0, 20, 45, 50] and plan.constants["max_length_q"] >= 25
    assert rel_err(ours.loss, theirs.loss) < 1e-6 and rel_err(ours.aux_loss, theirs.aux_loss) < 1e-6
    ours.loss.backward()
    theirs.loss.backward()
    for (name, mine), ref in zip(padded.named_parameters(), reference.parameters()):
        if ref.grad is not None:
            assert rel_err(mine.grad, ref.grad) < 1e-5, name
    shifted = positions + (torch.arange(50) >= 30).long()[None]  # the second document skips a position
    assert graphed_backbone.plan_batch({"input_ids": ids, "position_ids": shifted}) is None
    assert graphed_backbone.plan_batch({"input_ids": ids, "position_ids": positions + 1}) is None


def test_batches_where_padding_is_not_exact_run_as_before(monkeypatch):
    """Left padding, or a prediction at a pad that is scored: the stack runs Transformers' masked path."""
    reference, padded, _ = _eager_padded_pair(tiny_qwen3_moe_config())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    right = (torch.arange(16) < torch.tensor([16, 9])[:, None]).long()
    from moetune.training import graphed_backbone

    plans = []
    monkeypatch.setattr(graphed_backbone, "plan_batch", _spy(graphed_backbone.plan_batch, plans))
    for mask, labels in ((right.flip(-1), ids), (right, ids)):  # left-padded; right-padded with pads scored
        assert rel_err(padded(input_ids=ids, attention_mask=mask, labels=labels).loss,
                       reference(input_ids=ids, attention_mask=mask, labels=labels).loss) < 1e-6  # fmt: skip
    assert plans == [None, None]


def _probe_accumulate_node(param: torch.nn.Parameter):
    """A weak reference to an object kept in the metadata of ``param``'s AccumulateGrad node: dead once
    no autograd graph holds that node any more."""
    import weakref

    class Probe:
        pass

    probe = Probe()
    torch.autograd.graph.get_gradient_edge(param).node.metadata["probe"] = probe
    return weakref.ref(probe)


def test_the_padded_eager_run_lets_its_graph_go_after_the_backward():
    """A plain loop keeps its last ``loss`` (and so its autograd graph) alive into the next forward; a
    graph through the parameters that outlives its step holds their AccumulateGrad nodes, whose
    stream (the default one) then breaks the next capture. The graphs' eager runs are islands whose
    backward drops their graph: after ``loss.backward()`` no node of the stack's parameters stays
    alive, though ``loss`` does (the reference model's stay). A caller's own eager forward (a batch the
    graphs do not take) is tracked until its graph is gone, and no capture starts meanwhile."""
    reference, padded, runner = _eager_padded_pair(tiny_qwen3_moe_config())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    probes = {}
    losses = {}
    for name, model in (("padded", padded), ("reference", reference)):
        loss = model(input_ids=ids, labels=ids).loss
        probes[name] = _probe_accumulate_node(model.model.layers[0].mlp.experts.gate_up_proj)
        assert runner.eager_reason is None
        loss.backward()
        losses[name] = loss  # alive, as in a loop: loss = model(...).loss; loss.backward()
    assert probes["padded"]() is None and probes["reference"]() is not None
    assert not runner.eager_graph_alive()
    for (name, mine), ref in zip(padded.named_parameters(), reference.parameters()):
        assert rel_err(mine.grad, ref.grad) < 1e-6, name
    left_padded = (torch.arange(16) >= torch.tensor([0, 5])[:, None]).long()  # the graphs do not take it
    loss = padded(input_ids=ids, attention_mask=left_padded, labels=ids).loss
    assert runner.eager_reason is not None and runner.eager_graph_alive()
    loss.backward()
    assert runner.eager_graph_alive()  # the caller's graph lives as long as its loss
    del loss
    assert not runner.eager_graph_alive()


def test_eager_graphs_are_tracked_under_torch_compile():
    """Under ``torch.compile`` (Trainer's ``torch_compile=True``) the caller's eager forward is tracked
    as well (outside dynamo), and let go with its graph."""
    import gc

    _, padded, runner = _eager_padded_pair(tiny_qwen3_moe_config())
    compiled = torch.compile(padded, backend="eager")
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(6))
    left_padded = (torch.arange(16) >= torch.tensor([0, 5])[:, None]).long()
    for _ in range(2):
        loss = compiled(input_ids=ids, attention_mask=left_padded, labels=ids).loss
        assert runner.eager_reason is not None and runner.eager_graph_alive()
        loss.backward()
        del loss
        gc.collect()  # the first compilation leaves a reference cycle behind
        assert not runner.eager_graph_alive()
    loss = compiled(input_ids=ids, labels=ids).loss  # the padded path
    assert runner.eager_reason is None
    loss.backward()
    assert not runner.eager_graph_alive()


def test_runs_of_several_processes_train_eagerly(monkeypatch):
    """Under DDP (Trainer on several GPUs without ep_size) the all-reduce starts from hooks on the
    parameters' AccumulateGrad nodes, which a replayed backward skips: such runs take the eager path."""
    _, padded, runner = _eager_padded_pair(tiny_qwen3_moe_config())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(7))
    padded(input_ids=ids, labels=ids)
    assert runner.eager_reason is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    padded(input_ids=ids, labels=ids)
    assert runner.eager_reason is not None and "several processes" in runner.eager_reason


def test_hooks_on_the_gradients_keep_the_eager_path():
    """A hook on a parameter's gradient (an optimizer in the backward, a gradient filter) would not
    run in a replayed backward: the stack then runs eagerly, and the hook runs."""
    _, padded, runner = _eager_padded_pair(tiny_qwen3_moe_config())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(8))
    seen = []
    weight = padded.model.layers[0].self_attn.q_proj.weight
    handle = weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.norm()))
    padded(input_ids=ids, labels=ids).loss.backward()
    assert runner.eager_reason == "hooks on the parameters' gradients" and len(seen) == 1
    handle.remove()
    padded(input_ids=ids, labels=ids)
    assert runner.eager_reason is None


def test_a_second_backward_through_one_forward_is_refused():
    """The graphs' path keeps no autograd graph to go through twice (``retain_graph=True``): it says so
    and names the switch, where writing the gradients again would be silently wrong."""
    _, padded, _ = _eager_padded_pair(tiny_qwen3_moe_config())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(9))
    loss = padded.model(input_ids=ids).last_hidden_state.float().square().mean()  # a loss of the user's own
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="set_training_graphs"):
        loss.backward()


def test_cuda_graphs_option_switches_the_graphs_off():
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), cuda_graphs=False)
    assert model.model.cuda_graph_training is False
    set_training_graphs(model, True)
    assert model.model.cuda_graph_training is True
    with pytest.raises(ValueError, match="cuda_graphs"):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), cuda_graphs="yes")


def _spy(fn, calls: list):
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append(result)
        return result

    return wrapper


# -- on a GPU: the replays against the eager model --


def _cuda_pair(*, config=None, aux_loss: bool = True, **overrides):
    """(graphed model, its copy whose stack runs the same bucket-padded batches eagerly). The padding is
    exact (the CPU tests above, in fp32); on the GPU in bf16 the padded shapes change the kernels'
    rounding, which flips near-tied expert choices of a tiny random model. Against the same shapes, a
    replay must equal the eager run."""
    torch.manual_seed(0)
    if config is None:
        config = tiny_qwen3_moe_config(vocab_size=128, hidden_size=64, moe_intermediate_size=32,
                                       output_router_logits=aux_loss, **overrides)  # fmt: skip
    with torch.device("cuda"):
        graphed = moetune.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    eager = copy.deepcopy(graphed)
    eager.model.__dict__["_training_graphs"] = TrainingGraphs(eager.model, use_graphs=False)
    return graphed, eager


def _padded_batch(lengths: list[int], width: int, *, seed: int, vocab_size: int = 128) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(lengths), width), generator=generator)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": ids.masked_fill(mask == 0, -100).cuda()}


def _train(model, steps: list[list[dict]], *, set_to_none: bool = True, autocast: bool = False) -> tuple[list[float], list[dict]]:
    """A plain loop shaped like Trainer's: micro-batches, backward, clip, AdamW, zero_grad; losses and
    the gradients before each optimizer step. Like most plain loops it keeps the last ``loss`` (and its
    autograd graph) alive into the next forward. ``autocast``: each forward under bf16 autocast, as
    Trainer's ``bf16=True`` runs it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for micro_batches in steps:
        for batch in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss / len(micro_batches)
            loss.backward()
            losses.append(loss.item())
        grads.append({name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return losses, grads


def _assert_same_training(graphed, eager, steps, **kwargs):
    losses_g, grads_g = _train(graphed, steps, **kwargs)
    losses_e, grads_e = _train(eager, steps, **kwargs)
    torch.testing.assert_close(torch.tensor(losses_g), torch.tensor(losses_e), rtol=2e-3, atol=2e-3)
    for step, (mine, theirs) in enumerate(zip(grads_g, grads_e)):
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert rel_err(mine[name], theirs[name]) < 3e-2, (step, name)
    runner = graphed.model.__dict__.get("_training_graphs")
    assert runner is not None and runner.disabled_reason is None, runner and runner.disabled_reason
    return runner


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_replayed_steps_train_like_the_eager_model_with_accumulation_and_buckets(checkpointing):
    graphed, eager = _cuda_pair()
    if checkpointing:  # TRL's default: the recomputation is captured in the backward graph
        for model in (graphed, eager):
            model.gradient_checkpointing_enable()
    lengths = [[300, 120], [300, 300], [90, 200], [512, 40], [700, 650], [260, 100]]
    steps = [[_padded_batch(ls, max(ls), seed=10 * i + j) for j in range(2)] for i, ls in enumerate(lengths * 2)]
    runner = _assert_same_training(graphed, eager, steps)
    assert runner.replays >= 10
    assert {key[0] for key in runner._buckets} == {"rows"} and len(runner._buckets) >= 3


@pytest.mark.gpu
@needs_cuda
def test_replayed_nemotron_h_steps_under_autocast():
    """Trainer's ``bf16=True`` runs the forward under autocast, and Nemotron-H's Mamba-2 regions are
    compiled. The capture used to switch autocast's cache off, a state torch.compile guards on: the
    regions recompiled inside the capture, which failed (an H100, 2026-12-07), and the model trained
    eagerly from then on."""
    config = tiny_family_config("nemotron_h", vocab_size=128)
    graphed, eager = _cuda_pair(config=config)
    steps = [[_padded_batch(lengths, max(lengths), seed=i)] for i, lengths in enumerate([[200, 120], [256, 256]] * 3)]
    runner = _assert_same_training(graphed, eager, steps, autocast=True)
    assert runner.replays >= 3


def test_the_capture_keeps_the_state_torch_compile_guards_on():
    """The autocast cache is emptied around a capture, not switched off: a compiled region called inside
    runs its compiled code instead of recompiling (which would invalidate a capture)."""
    import torch._dynamo

    from moetune.training.graphed_backbone import _fresh_autocast_cache

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False, fullgraph=True)
    x = torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x)
        with torch._dynamo.config.patch(error_on_recompile=True), _fresh_autocast_cache():
            compiled(x)
            assert torch.is_autocast_cache_enabled()


@pytest.mark.gpu
@needs_cuda
def test_replayed_steps_with_user_zeroed_gradients_and_two_forwards():
    graphed, eager = _cuda_pair(aux_loss=False)
    steps = [[_padded_batch([256, 256], 256, seed=i)] for i in range(6)]
    runner = _assert_same_training(graphed, eager, steps, set_to_none=False)
    assert runner.replays >= 3
    # Two forwards, then one backward of their sum (the second forward runs eagerly while the first's
    # activations wait in the graphs' memory), three times: warm-up, capture, replay.
    replays = runner.replays
    for round_ in range(3):
        batches = [_padded_batch([256], 256, seed=20 + 2 * round_ + i) for i in range(2)]
        sums = []
        for model in (graphed, eager):
            model.zero_grad(set_to_none=True)
            (model(**batches[0]).loss + model(**batches[1]).loss).backward()
            sums.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
        assert sums[0].keys() == sums[1].keys()
        for name in sums[1]:
            assert rel_err(sums[0][name], sums[1][name]) < 3e-2, (round_, name)
    assert runner.replays > replays


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("offsets_given", [True, False], ids=["offsets", "positions-only"])
def test_replayed_padding_free_steps(offsets_given):
    graphed, eager = _cuda_pair()
    steps = []
    for i in range(8):
        lengths = [100 + 37 * i, 300, 60 + 11 * i]
        total = sum(lengths)
        ids = torch.randint(0, 128, (1, total), generator=torch.Generator().manual_seed(i)).cuda()
        positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
        offsets = document_offsets([lengths], row_length=total).cuda()
        steps.append([dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets.clone(),
                           max_length_q=max(lengths), max_length_k=max(lengths),
                           labels=ids.masked_fill(positions == 0, -100))])  # fmt: skip
        if not offsets_given:  # TRL's packing under SDPA: the positions alone
            steps[-1] = [{k: v for k, v in steps[-1][0].items() if k in ("input_ids", "position_ids", "labels")}]
    runner = _assert_same_training(graphed, eager, steps)
    assert runner.replays >= 2 and {key[0] for key in runner._buckets} == {"documents"}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rank", [4, 16])
def test_replayed_steps_with_peft_lora_on_the_experts(rank):
    """Rank 16 reaches torch's grouped GEMM in PEFT's own layout of the factors (experts' dimension
    innermost); rank 4 is padded to 8 first."""
    peft = pytest.importorskip("peft")
    graphed, eager = _cuda_pair(aux_loss=False)
    models = []
    for model in (graphed, eager):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
        models.append(peft.get_peft_model(model, config))
    steps = [[_padded_batch([256, 200], 256, seed=i)] for i in range(6)]
    losses_and_grads = [_train(model, steps) for model in models]
    torch.testing.assert_close(torch.tensor(losses_and_grads[0][0]), torch.tensor(losses_and_grads[1][0]), rtol=2e-3, atol=2e-3)
    for mine, theirs in zip(losses_and_grads[0][1], losses_and_grads[1][1]):
        assert mine.keys() == theirs.keys() and all("lora" in name for name in theirs)
        for name in theirs:
            assert rel_err(mine[name], theirs[name]) < 3e-2, name
    assert graphed.model.__dict__["_training_graphs"].replays >= 3


@pytest.mark.gpu
@needs_cuda
def test_moetune_trainer_steps_moetunes_adamw_with_the_clipping_folded_in(tmp_path):
    """``moetune.Trainer`` on one GPU: moetune's AdamW (the same update as the default torch AdamW,
    clipping's coefficient applied in its kernel) trains as Transformers' Trainer does."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from moetune.optim import AdamW

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(0, 128, (256,), generator=generator).tolist()), "labels": ids}
            for _ in range(8)]  # fmt: skip
    losses, optimizers = {}, {}
    for name, trainer_cls in (("transformers", transformers.Trainer), ("moetune", moetune.Trainer)):
        graphed, _ = _cuda_pair(aux_loss=False)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
            max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], bf16=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_cls(model=graphed, args=args, train_dataset=datasets.Dataset.from_list(rows))
        trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        optimizers[name] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer))
    assert optimizers["moetune"] is AdamW and optimizers["transformers"] is torch.optim.AdamW
    torch.testing.assert_close(torch.tensor(losses["moetune"]), torch.tensor(losses["transformers"]), rtol=2e-2, atol=2e-2)


def test_experts_that_read_their_counts_on_the_host_are_not_captured():
    """The per-expert loop (weights other than bf16, outside bf16 autocast, or the loop backend) sizes
    its splits from counts read on the host, which a capture cannot: such stacks train eagerly without
    trying one (it would fail with a warning)."""
    from moetune.models.options import set_moe_options
    from moetune.moe import GroupedExperts
    from moetune.training.graphed_backbone import _experts_read_counts_on_the_host

    def experts(dtype, **options):
        model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), dtype=dtype)
        set_moe_options(model, **options)
        return [m for m in model.modules() if isinstance(m, GroupedExperts)]

    assert _experts_read_counts_on_the_host(experts(torch.float32))
    assert _experts_read_counts_on_the_host(experts(torch.bfloat16))  # on CPU: no grouped GEMM either
    assert _experts_read_counts_on_the_host(experts(torch.bfloat16, experts_backend="loop"))
    assert not _experts_read_counts_on_the_host(experts(torch.bfloat16, experts_backend="triton"))
