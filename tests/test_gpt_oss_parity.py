"""moetune's GPT-OSS equals Transformers' on tiny fp32 configs: logits, loss + aux loss, gradients
(biased, transposed experts; sinks; sliding windows), generation; expert parallelism equals one
process; LoRA on the transposed experts; plain Transformers loads what moetune saves."""

from __future__ import annotations

import pytest
import torch
import transformers

import moetune
from moetune.models.gpt_oss.model import GptOssForCausalLM
from moetune.moe import GroupedExperts, TopKThenSoftmaxRouter
from tests.conftest import (
    check_bf16_training_parity,
    check_packed_documents_parity,
    check_generation_and_reload,
    check_training_parity,
    parity_batch,
    save_with_transformers,
    seeded_reference,
)

TOL = 1e-5
CONFIGS = {
    "sliding-and-full": {},
    "full-only-top3": {"layer_types": ["full_attention", "full_attention"], "num_experts_per_tok": 3},
}


def tiny_gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    settings = dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, rope_scaling=None, output_router_logits=True, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    settings.update(overrides)
    return transformers.GptOssConfig(**settings)


def reference(**overrides) -> transformers.GptOssForCausalLM:
    """Random fp32 weights with non-zero expert and router biases."""
    return seeded_reference(
        transformers.GptOssForCausalLM, tiny_gpt_oss_config(**overrides), randomized_suffixes=("_bias", "router.bias")
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True])
def test_forward_backward_parity(tmp_path, name, padded):
    ref = reference(**CONFIGS[name])
    ours = moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path))
    assert isinstance(ours, GptOssForCausalLM) and ours.config._attn_implementation == "eager"
    assert any(isinstance(m, TopKThenSoftmaxRouter) for m in ours.modules())
    experts = next(m for m in ours.modules() if isinstance(m, GroupedExperts))
    assert experts.is_transposed and experts.has_bias
    check_training_parity(ours, ref, padded=padded)

def test_greedy_generation_and_plain_transformers_reload(tmp_path):
    # Without router logits: Transformers < 5.2x's own GPT-OSS generate fails computing the aux loss
    # against the growing KV-cache mask.
    ref = reference(output_router_logits=False)
    check_generation_and_reload(moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path)), ref, tmp_path)

def test_from_config_follows_transformers_init_and_the_balanced_gate():
    model = moetune.AutoModelForCausalLM.from_config(tiny_gpt_oss_config(), balanced_gate=True)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 32, 32) and experts.down_proj.shape == (8, 16, 32)
    assert torch.count_nonzero(experts.gate_up_proj_bias) == 0 and torch.count_nonzero(experts.down_proj_bias) == 0
    router = model.model.layers[0].mlp.router
    assert router.weight.std() > 0 and router.bias.std() > 0
    assert router(torch.randn(3, 32)).experts_TK.flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_lora_on_transposed_experts_trains_only_the_adapters(tmp_path):
    from moetune.lora import LoraSettings

    ours = moetune.AutoModelForCausalLM.from_pretrained(
        save_with_transformers(reference(), tmp_path), lora=LoraSettings(rank=4, target_modules=["q_proj"], target_experts=True)
    ).train()
    ids, _, labels = parity_batch(96, padded=False)
    ours(input_ids=ids, labels=labels).loss.backward()
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n for n in trainable)
    assert any("lora_A_gate_up_proj" in n for n in trainable)
    assert all(p.grad is not None for n, p in ours.named_parameters() if n in trainable)


@pytest.mark.distributed
def test_expert_parallel_two_processes_equal_one_process(tmp_path):
    """ep=2 under gloo: the experts' weights and biases split by expert; SGD + clipping and AdamW
    equal one process; the gathered save equals the single-process save. No aux loss: under expert
    parallelism each rank's aux loss sees only its own tokens."""
    from tests.distributed import workers
    from tests.distributed.helpers import spawn

    folder = save_with_transformers(reference(vocab_size=64, output_router_logits=False), tmp_path)
    spawn(workers.train_parity, 2, str(folder), 2, str(tmp_path / "out"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts_backend", ["auto", "quack"])
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers(tmp_path, experts_backend):
    """bf16 on CUDA (grouped GEMMs with per-expert biases): loss and gradients within 1e-2 of
    Transformers in fp32 holding the same weights, or no further than Transformers' bf16."""
    folder = save_with_transformers(reference(hidden_size=64, intermediate_size=32), tmp_path)
    check_bf16_training_parity(folder, vocab=96, experts_backend=experts_backend)


def _mxfp4_checkpoint(tmp_path, **overrides):
    """A GPT-OSS checkpoint whose expert weights are MXFP4 (random codes and exponents), as on the
    Hub, and the fp32 Transformers model holding their dequantized values."""
    import json

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moetune.checkpoint.mxfp4 import quantized_shapes

    ref = reference(intermediate_size=32, **overrides)  # MXFP4 groups of 32 along each input dim
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks_shape, scales_shape = quantized_shapes(tuple(param.shape))
                blocks = torch.randint(0, 256, blocks_shape, generator=generator, dtype=torch.uint8)
                scales = torch.randint(118, 124, scales_shape, generator=generator, dtype=torch.uint8)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            else:
                tensors[name] = param.detach().clone()
    folder = tmp_path / "mxfp4"
    ref.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return ref, folder


def test_mxfp4_experts_are_dequantized_while_loading(tmp_path):
    """The Hub's MXFP4 experts load into moetune's model dequantized exactly as Transformers does;
    the loaded model and what it saves are plain (no quantization_config)."""
    ref, folder = _mxfp4_checkpoint(tmp_path)
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(ours, GptOssForCausalLM) and getattr(ours.config, "quantization_config", None) is None
    ref_params = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    check_training_parity(ours, ref, padded=False)
    ours.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()


def test_mxfp4_checkpoint_with_a_missing_scale_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = _mxfp4_checkpoint(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model.layers.0.mlp.experts.down_proj_scales"):
        moetune.AutoModelForCausalLM.from_pretrained(folder)


def test_mxfp4_checkpoint_of_other_expert_sizes_is_reported_as_mis_shaped_only(tmp_path):
    """Blocks of another shape are one problem: named as mis-shaped, not also as missing tensors."""
    _, folder = _mxfp4_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"mis-shaped tensors \(\d+\): model.layers.0.mlp.experts.down_proj_blocks") as error:
        moetune.AutoModelForCausalLM.from_pretrained(folder, intermediate_size=64)
    assert "missing tensors" not in str(error.value)


@pytest.mark.distributed
def test_mxfp4_under_expert_parallelism_reads_each_ranks_experts(tmp_path):
    from tests.distributed import workers
    from tests.distributed.helpers import spawn

    _, folder = _mxfp4_checkpoint(tmp_path, vocab_size=64, output_router_logits=False)
    # Parity only: this model starts at ln(64), the entropy of the random tokens it trains on.
    spawn(workers.train_parity, 2, str(folder), 2, str(tmp_path / "out"), True, False)


def test_unmasked_batches_take_moetune_sink_attention(tmp_path, monkeypatch):
    """Without a mask (a plain training step) every layer applies its causal mask, sliding window
    (4 here, shorter than the batch) and sinks itself (``moetune.layers.sink_attention``), and the
    model still equals Transformers' masked eager attention."""
    import moetune.models.gpt_oss.model as gpt_oss_model

    calls = []
    real = gpt_oss_model.sink_attention
    monkeypatch.setattr(gpt_oss_model, "sink_attention", lambda *a, **k: calls.append(k["sliding_window"]) or real(*a, **k))
    ref = reference()
    check_training_parity(moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path)), ref, padded=False)
    assert calls and set(calls) == {4, None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's flash kernels)")
@pytest.mark.parametrize(
    "window, packed, kernel",
    [(128, False, "flash"), (128, True, "flash"), (None, False, "flash"), (None, True, "flash"), (None, False, "cudnn")],
    ids=["window-rows", "window-packed", "full-rows-flash", "full-packed", "full-rows-cudnn"],
)
def test_flash_sink_attention_on_gpu_is_as_close_to_fp32_as_eager(window, packed, kernel, monkeypatch):
    """GPT-OSS-20B's head layout (64 query / 8 key-value heads of 64), bf16: the flash (or cuDNN)
    kernels with the sinks folded in against Transformers' eager math in fp32 (output and the
    gradients of q, k, v and the sinks), no further off than the eager math in bf16; packed:
    documents of 300, 200 and 500 tokens per row, offsets padded with repeats. cuDNN takes the full
    attention of unpacked rows where it runs (sm90 / sm100); the flash kernels take the rest."""
    import moetune.layers.sink_attention as sink_module
    from moetune.layers.document_attention import flash_kernels_apply
    from moetune.layers.sink_attention import _allowed_keys, _eager_sink_attention, sink_attention
    from tests.conftest import rel_err

    if kernel == "flash":
        monkeypatch.setattr(sink_module, "cudnn_attention_applies", lambda q: False)
    elif not sink_module.cudnn_attention_applies(torch.zeros(1, 1, 1, 64, device="cuda").bfloat16()):
        pytest.skip("cuDNN takes the sinks' full attention on sm90 / sm100 with cuDNN >= 9.10 only")
    cudnn_calls = []
    real_apply = sink_module._CudnnWithSinks.apply
    monkeypatch.setattr(sink_module._CudnnWithSinks, "apply", lambda *a: cudnn_calls.append(1) or real_apply(*a))

    torch.manual_seed(0)
    q = torch.randn(2, 64, 1000, 64, device="cuda")
    k, v = torch.randn(2, 8, 1000, 64, device="cuda"), torch.randn(2, 8, 1000, 64, device="cuda")
    sinks = torch.randn(64, device="cuda")
    probe = torch.randn(2, 1000, 64, 64, device="cuda")
    offsets = torch.tensor([0, 300, 500, 1000, 1300, 1500, 2000, 2000, 2000], device="cuda") if packed else None
    allowed = _allowed_keys(2, 1000, sliding_window=window, offsets_N=offsets, device=q.device)

    def flash(*leaves):
        return sink_attention(*leaves, scaling=0.125, sliding_window=window, offsets_N=offsets,
                              max_length=500 if packed else None)

    def eager(*leaves):
        return _eager_sink_attention(*leaves, scaling=0.125, allowed_BSS=allowed)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        out = fn(*leaves)
        return [out.detach().float(), *(g.float() for g in torch.autograd.grad((out.float() * probe).sum(), leaves))]

    assert flash_kernels_apply(q.bfloat16())
    reference = run(eager, torch.float32)
    eager_bf16 = run(eager, torch.bfloat16)
    flash_bf16 = run(flash, torch.bfloat16)
    for name, got, eager_err, ref in zip(("out", "dq", "dk", "dv", "dsinks"), flash_bf16, eager_bf16, reference):
        assert rel_err(got, ref) <= max(1e-2, 1.5 * rel_err(eager_err, ref)), name
    assert bool(cudnn_calls) == (kernel == "cudnn")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's flash kernels)")
def test_fp32_weights_under_bf16_autocast_take_the_flash_sink_attention(tmp_path, monkeypatch):
    """The recipe's default precision on GPU: RoPE's fp32 cos / sin promote q and k to fp32, and the
    attention still runs the flash kernels in bf16 (not the eager fp32 scores), as close to the
    fp32 model as Transformers' eager attention under the same autocast."""
    import moetune.layers.sink_attention as sink_module
    from tests.conftest import rel_err

    flash_calls = []  # either kernel: cuDNN takes the full-attention layers on sm90 / sm100
    for kernel in (sink_module._FlashWithSinks, sink_module._CudnnWithSinks):
        monkeypatch.setattr(kernel, "apply", lambda *a, real=kernel.apply: flash_calls.append(1) or real(*a))
    ref = reference(hidden_size=64, intermediate_size=32).cuda()
    ours = moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path)).cuda().train()
    ids = torch.randint(0, 96, (2, 40), device="cuda")
    with torch.no_grad():
        exact = ref(input_ids=ids).logits
        with torch.autocast("cuda", dtype=torch.bfloat16):
            theirs = ref(input_ids=ids).logits.float()
            got = ours(input_ids=ids, return_logits=True).logits.float()
    assert flash_calls
    assert rel_err(got, exact) <= max(1e-2, 1.5 * rel_err(theirs, exact))


def test_packed_rows_with_offsets_equal_each_document_alone(tmp_path):
    """Packed rows with their documents' offsets: sinks, the sliding window of 4 inside longer
    documents and full attention stay inside each document, with no mask from anyone."""
    ref = reference(output_router_logits=False)
    ours = moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path))
    assert ours.model.takes_document_offsets
    check_packed_documents_parity(ours, ref)
