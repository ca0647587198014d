"""training.cuda_graph and the packed documents' offsets: the graphed step's code computes what the
eager step computes (on CPU both run eagerly; the H200 replay is checked by
tests/test_gpu_losses.py), the offsets describe the packed rows, and what cannot be captured is
refused with the field's name."""

from __future__ import annotations

import json

import pytest
import torch

from moetune.recipe.config_loading import load_config
from moetune.recipe.formatting import IGNORE_INDEX, Sample
from moetune.recipe.packing import collate, max_documents_per_row
from moetune.recipe.train import finetune


def _final_record(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]


@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_step_equals_the_eager_step(tiny_job, tmp_path, accum, monkeypatch):
    from moetune.recipe.step import GraphedTrainStep

    calls = []
    real_call = GraphedTrainStep.__call__
    monkeypatch.setattr(GraphedTrainStep, "__call__", lambda self, batches: calls.append(1) or real_call(self, batches))
    options = {"training__steps": 4, "training__grad_accum_steps": accum, "training__micro_batch_size": 2 // accum}
    eager = finetune(tiny_job(tmp_path / "eager", **options))
    assert not calls
    graphed = finetune(tiny_job(tmp_path / "graphed", training__cuda_graph="true", **options))
    assert len(calls) == 4
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-6)
    assert graphed.val_loss == pytest.approx(eager.val_loss, rel=1e-6)
    assert _final_record(tmp_path / "graphed")["expert_tokens"] == _final_record(tmp_path / "eager")["expert_tokens"]


def test_graphed_step_under_autocast_equals_the_eager_step(tiny_job, tmp_path):
    """bf16 autocast (the recipe's default on GPU); the graphed step's autocast keeps no cast cache."""
    options = {"training__steps": 3, "training__precision": "bf16_autocast"}
    eager = finetune(tiny_job(tmp_path / "eager", **options))
    graphed = finetune(tiny_job(tmp_path / "graphed", training__cuda_graph="true", **options))
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-6)


def _samples(*lengths: int) -> list[Sample]:
    return [Sample(input_ids=list(range(3, 3 + n)), labels=list(range(3, 3 + n))) for n in lengths]


def test_packed_batches_carry_their_documents_offsets():
    batch = collate([_samples(3, 4), _samples(8)], pad_id=0, max_length=8, packed=True)
    assert batch.document_lengths == [[3, 4, 1], [8]]
    exact = batch.model_inputs(torch.device("cpu"), document_offsets=True)
    assert exact["cu_seq_lens_q"].tolist() == [0, 3, 7, 8, 16] and exact["max_length_q"] == 8
    padded = batch.model_inputs(torch.device("cpu"), document_offsets=True, num_offsets=7)
    assert padded["cu_seq_lens_q"].tolist() == [0, 3, 7, 8, 16, 16, 16] and padded["max_length_q"] == 8
    assert "cu_seq_lens_q" not in batch.model_inputs(torch.device("cpu"))
    unpacked = collate([_samples(3)], pad_id=0, max_length=8, packed=False)
    assert "cu_seq_lens_q" not in unpacked.model_inputs(torch.device("cpu"), document_offsets=True)
    # Each row holds at most max_length // shortest samples, plus the padding run.
    assert max_documents_per_row(_samples(5, 2, 9), max_length=8) == 5
    assert max_documents_per_row([Sample(input_ids=[1], labels=[IGNORE_INDEX])], max_length=8) == 8


def test_cuda_graph_needs_packing():
    with pytest.raises(ValueError, match="training.cuda_graph: needs data.packing"):
        load_config(overrides=["training.cuda_graph=true", "data.packing=false"])


def test_cuda_graph_refuses_models_that_derive_masks_on_the_host(tiny_job, tmp_path):
    """A model that falls back to Transformers' classes (Mixtral) builds packed rows' masks from the
    position_ids on the host: refused before anything is loaded, naming the field."""
    import transformers

    transformers.MixtralConfig(
        vocab_size=309, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    with pytest.raises(ValueError, match="training.cuda_graph: MixtralForCausalLM derives packed rows"):
        finetune(tiny_job(tmp_path / "out", model__config_path=tmp_path / "model", training__cuda_graph="true"))


def test_graphed_step_resumes_exactly(tiny_job, tmp_path):
    out = tmp_path / "resume"
    full = finetune(tiny_job(tmp_path / "full", training__steps=6, training__cuda_graph="true"))
    finetune(tiny_job(out, training__steps=3, checkpoint__every=3, training__cuda_graph="true"))
    resumed = finetune(tiny_job(out, training__steps=6, checkpoint__resume="auto", training__cuda_graph="true"))
    assert resumed.losses == full.losses[3:]


def test_graphed_step_trains_lora_as_the_eager_step(tiny_job, tmp_path):
    options = {"training__steps": 3, "lora__enabled": "true", "checkpoint__export_final": "false"}
    eager = finetune(tiny_job(tmp_path / "eager", **options))
    graphed = finetune(tiny_job(tmp_path / "graphed", training__cuda_graph="true", **options))
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-6)


def test_graphed_step_stops_on_nan_before_the_update(tiny_job, tmp_path, monkeypatch):
    from moetune.recipe import step as step_module
    from moetune.recipe.train import NonFiniteLossError

    real_clip = step_module.clip_grad_norm
    calls = {"n": 0}

    def poisoned_clip(model, **options):
        calls["n"] += 1
        if calls["n"] == 2:
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        return real_clip(model, **options)

    monkeypatch.setattr(step_module, "clip_grad_norm", poisoned_clip)
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match=r"step 2: loss .*grad norm nan.*last good checkpoint is .*step_00000001"):
        finetune(tiny_job(out, training__steps=4, checkpoint__every=1, training__cuda_graph="true"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the graphs are captured and replayed)")
def test_graphed_recipe_on_gpu_trains_as_the_eager_one(tiny_job, tmp_path):
    """On CUDA the steps after the two eager ones replay graphs (bf16 autocast, the recipe's default
    there): the losses, validation loss and expert counts follow the eager run's."""
    options = {"training__steps": 6, "training__device": "cuda"}
    eager = finetune(tiny_job(tmp_path / "eager", **options))
    graphed = finetune(tiny_job(tmp_path / "graphed", training__cuda_graph="true", **options))
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-3)
    assert graphed.val_loss == pytest.approx(eager.val_loss, rel=1e-3)


def _family_config(family: str, folder):
    """None for the default job's Qwen3-MoE; else a tiny config of ``family`` saved to ``folder``."""
    if family == "qwen3_moe":
        return None
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    make_config = {"nemotron_h": tiny_nemotron_h_config, "gpt_oss": tiny_gpt_oss_config,
                   "deepseek_v3": tiny_deepseek_v3_config}[family]
    make_config(vocab_size=309, max_position_embeddings=512).save_pretrained(folder)
    return folder


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "nemotron_h", "deepseek_v3"])
def test_eager_recipe_queues_forward_and_backward_without_host_sync(tiny_job, tmp_path, monkeypatch, family):
    """From the loss of a micro-batch to the clipping's read of the norm, the eager step never makes
    the host wait for the GPU (a blocking copy of the expert-load mask per layer once did, so the host
    queued the backward only after the whole forward had run). The first step may sync (lazy init)."""
    from moetune.recipe import step as step_module

    config_path = _family_config(family, tmp_path / "model")
    model = {"model__config_path": config_path} if config_path else {}

    real_loss, real_clip = step_module.micro_batch_loss, step_module.clip_grad_norm
    calls = {"loss": 0, "strict": 0}

    def strict_loss(*args, **kwargs):
        calls["loss"] += 1
        if calls["loss"] > 2:  # after the first step (2 micro-batches): forward and backward watched
            calls["strict"] += 1
            torch.cuda.set_sync_debug_mode("error")
        return real_loss(*args, **kwargs)

    def clip(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("default")  # the norm's read (the NaN check) syncs by design
        return real_clip(*args, **kwargs)

    monkeypatch.setattr(step_module, "micro_batch_loss", strict_loss)
    monkeypatch.setattr(step_module, "clip_grad_norm", clip)
    try:
        finetune(tiny_job(tmp_path / "eager", training__steps=3, training__device="cuda",
                          training__grad_accum_steps=2, training__micro_batch_size=1, **model))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls["strict"] == 4


def test_several_processes_need_the_capturable_expert_parallel_settings():
    from moetune.recipe.distributed_setup import Runtime
    from moetune.recipe.train import _check_graph_sharding

    two = Runtime(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="training.cuda_graph: with several processes"):
        _check_graph_sharding(load_config(overrides=["training.cuda_graph=true"]), two)
    capturable = load_config(overrides=["training.cuda_graph=true", "distributed.ep_size=2",
                                        "distributed.ep_dispatch=allgather", "distributed.dense_parallel=replicate"])
    _check_graph_sharding(capturable, two)


def test_cuda_graph_setting_is_true_false_or_auto():
    assert load_config().training.cuda_graph == "auto"
    for given, expected in [("true", "true"), ("True", "true"), ("yes", "true"), ("false", "false"), ("0", "false"),
                            ("auto", "auto"), ("AUTO", "auto")]:
        assert load_config(overrides=[f"training.cuda_graph={given}"]).training.cuda_graph == expected
    with pytest.raises(ValueError, match="training.cuda_graph: 'sometimes' is not one of"):
        load_config(overrides=["training.cuda_graph=sometimes"])
    # "auto" never fails a check that "true" fails: it resolves to eager there
    assert load_config(overrides=["data.packing=false"]).training.cuda_graph == "auto"


def test_auto_graphs_lora_in_one_cuda_process_with_packed_rows():
    from moetune.recipe.distributed_setup import Runtime
    from moetune.recipe.step import uses_cuda_graph

    gpu, cpu = (Runtime(rank=0, world_size=1, local_rank=0, device=torch.device(d)) for d in ("cuda", "cpu"))
    two_gpus = Runtime(rank=0, world_size=2, local_rank=0, device=torch.device("cuda"))
    lora = load_config(overrides=["lora.enabled=true"])
    assert uses_cuda_graph(lora, gpu, takes_offsets=True)
    assert not uses_cuda_graph(lora, gpu, takes_offsets=False)  # Transformers' own classes: masks on the host
    assert not uses_cuda_graph(lora, cpu, takes_offsets=True)
    assert not uses_cuda_graph(lora, two_gpus, takes_offsets=True)
    assert not uses_cuda_graph(load_config(overrides=["lora.enabled=true", "data.packing=false"]), gpu, takes_offsets=True)
    assert not uses_cuda_graph(load_config(), gpu, takes_offsets=True)  # full fine-tuning stays eager
    assert uses_cuda_graph(load_config(overrides=["training.cuda_graph=true"]), gpu, takes_offsets=True)
    assert not uses_cuda_graph(load_config(overrides=["lora.enabled=true", "training.cuda_graph=false"]), gpu,
                               takes_offsets=True)


def test_the_run_logs_whether_its_steps_are_graphed(tiny_job, tmp_path):
    finetune(tiny_job(tmp_path / "out", training__steps=1, lora__enabled="true", checkpoint__export_final="false"))
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["cuda_graph"] for r in records if "sharding" in r] == [False]  # auto, on CPU: eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the graphs are captured and replayed)")
def test_graphed_recipe_on_gpu_resumes_exactly_and_trains_lora(tiny_job, tmp_path):
    """Replayed graphs on CUDA: a run stopped at step 3 and resumed continues with the losses of the
    uninterrupted graphed run; LoRA (adapters only trainable) follows its eager run, and the default
    training.cuda_graph "auto" graphs it."""
    gpu = {"training__device": "cuda", "training__cuda_graph": "true"}
    full = finetune(tiny_job(tmp_path / "full", training__steps=6, **gpu))
    finetune(tiny_job(tmp_path / "resume", training__steps=3, checkpoint__every=3, **gpu))
    resumed = finetune(tiny_job(tmp_path / "resume", training__steps=6, checkpoint__resume="auto", **gpu))
    assert resumed.losses == pytest.approx(full.losses[3:], rel=1e-3)
    lora = {"training__steps": 5, "lora__enabled": "true", "checkpoint__export_final": "false", "training__device": "cuda"}
    eager = finetune(tiny_job(tmp_path / "lora_eager", training__cuda_graph="false", **lora))
    graphed = finetune(tiny_job(tmp_path / "lora_graphed", training__cuda_graph="true", **lora))
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-3)
    auto = finetune(tiny_job(tmp_path / "lora_auto", **lora))
    records = [json.loads(line) for line in (tmp_path / "lora_auto" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["cuda_graph"] for r in records if "sharding" in r] == [True]
    assert auto.losses == pytest.approx(graphed.losses, rel=1e-3)


@pytest.mark.parametrize("family", ["nemotron_h", "gpt_oss", "deepseek_v3"])
def test_graphed_step_trains_other_offset_taking_families_as_the_eager_step(tiny_job, tmp_path, family):
    """Nemotron-H (attention by offsets, Mamba-2 by document ids on the device), GPT-OSS (sinks and
    sliding windows inside each document) and DeepSeek-V3 (latent attention by offsets) take the
    documents' offsets, so the graphed step accepts them and computes what the eager step computes."""
    options = {"model__config_path": _family_config(family, tmp_path / "model"), "training__steps": 3}
    eager = finetune(tiny_job(tmp_path / "eager", **options))
    graphed = finetune(tiny_job(tmp_path / "graphed", training__cuda_graph="true", **options))
    assert graphed.losses == pytest.approx(eager.losses, rel=1e-6)
