"""moetune's DeepSeek-V3 (Kimi-K2's architecture) equals Transformers' on tiny fp32 configs: logits,
loss, gradients, generation, both checkpoint layouts; expert parallelism equals one process; plain
Transformers loads what moetune saves; FP8 checkpoints are refused before loading."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import moetune
from moetune.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moetune.moe import GroupLimitedSigmoidRouter
from tests.conftest import (
    check_packed_documents_parity,
    quantize_fp8_checkpoint,
    check_bf16_training_parity,
    check_generation_and_reload,
    check_training_parity,
    parity_batch,
    rel_err,
    save_per_expert_checkpoint,
    seeded_reference,
)

TOL = 1e-5
CONFIGS = {
    "q-lora-first-dense": {},
    "no-renorm-q-direct": {"norm_topk_prob": False, "q_lora_rank": None},
    "all-sparse-two-shared-tied": {"first_k_dense_replace": 0, "n_shared_experts": 2, "tie_word_embeddings": True},
}


def tiny_deepseek_v3_config(**overrides) -> transformers.DeepseekV3Config:
    settings = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None,
    )  # fmt: skip
    settings.update(overrides)
    return transformers.DeepseekV3Config(**settings)


def reference(**overrides) -> transformers.DeepseekV3ForCausalLM:
    """Random fp32 weights and a non-zero score-correction bias (so the group-limited choice uses it)."""
    return seeded_reference(
        transformers.DeepseekV3ForCausalLM, tiny_deepseek_v3_config(**overrides), randomized_suffixes=("e_score_correction_bias",)
    )


def _save(ref, tmp_path, layout: str):
    folder = tmp_path / layout
    if layout == "per-expert":
        return save_per_expert_checkpoint(ref, folder)
    ref.save_pretrained(folder, save_original_format=False)
    return folder


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_backward_parity(tmp_path, name, layout, padded):
    ref = reference(**CONFIGS[name])
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, layout))
    assert isinstance(ours, DeepseekV3ForCausalLM) and isinstance(ours, transformers.DeepseekV3ForCausalLM)
    assert any(isinstance(m, GroupLimitedSigmoidRouter) for m in ours.modules())
    check_training_parity(ours, ref, padded=padded)  # no aux loss on either side: the router bias balances

def test_router_logits_generation_and_plain_transformers_reload(tmp_path):
    ref = reference()
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "per-expert")).eval()
    ref.eval()
    ids = parity_batch(ref.config.vocab_size, padded=False)[0][:1, :5]
    expected = []  # Transformers' routers' logits (its outputs carry them only from 5.2x on)
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: expected.append(out[0] if isinstance(out, tuple) else out))
        for name, module in ref.named_modules() if name.endswith("mlp.gate")
    ]  # fmt: skip
    ref(input_ids=ids)
    for hook in hooks:
        hook.remove()
    got = ours(input_ids=ids, output_router_logits=True).router_logits
    assert len(got) == len(expected) == 2  # the first layer is dense
    for a, b in zip(got, expected):
        assert rel_err(a, b.reshape(a.shape)) < TOL
    check_generation_and_reload(ours, ref, tmp_path)

def test_bf16_router_has_transformers_dtypes_and_balanced_gate_works():
    """In bf16 the router's weight and correction bias have the dtypes Transformers' has (both fp32 in
    Transformers 5.2x; a bf16 weight and, from a config, a bf16 bias before), the experts bf16."""
    model = moetune.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16, balanced_gate=True)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16)
    router, ref_router = model.model.layers[1].mlp.gate, ref.model.layers[1].mlp.gate
    assert router.weight.dtype == ref_router.weight.dtype
    assert router.e_score_correction_bias.dtype == ref_router.e_score_correction_bias.dtype
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    routing = router(torch.randn(6, 32, dtype=torch.bfloat16))
    assert routing.experts_TK.flatten().tolist() == [j % 8 for j in range(12)]


@pytest.mark.parametrize("keeps_weight", [True, False])
def test_router_weight_dtype_follows_the_installed_transformers(keeps_weight, monkeypatch):
    """Transformers 5.2x keeps the router's weight in fp32 (``gate.weight`` in its
    ``_keep_in_fp32_modules_strict``); 5.1x kept only the correction bias, its weight in the model's
    dtype. moetune's router follows the installed version. (An fp32 weight among bf16 ones where
    Transformers had none made the Trainer's clipping scale each bf16 gradient by its own casting kernel.)"""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    names = ["e_score_correction_bias", "gate.weight"] if keeps_weight else ["e_score_correction_bias"]
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3PreTrainedModel, "_keep_in_fp32_modules_strict", names)
    model = moetune.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    assert router.weight.dtype == (torch.float32 if keeps_weight else torch.bfloat16)
    grad_dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert grad_dtypes == ({torch.bfloat16, torch.float32} if keeps_weight else {torch.bfloat16})


def test_multi_token_prediction_layer_is_ignored(tmp_path):
    """Hub checkpoints keep the MTP module as model.layers.61; Transformers ignores it, so does moetune."""
    folder = _save(reference(), tmp_path, "per-expert")
    save_file({"model.layers.61.eh_proj.weight": torch.zeros(4, 4)}, folder / "mtp.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in load_file(folder / "model.safetensors")}}
    index["weight_map"]["model.layers.61.eh_proj.weight"] = "mtp.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert isinstance(moetune.AutoModelForCausalLM.from_pretrained(folder), DeepseekV3ForCausalLM)


def test_multi_token_prediction_layers_follow_the_last_decoder_layer(tmp_path):
    """The MTP module is the layer after the checkpoint's last one (61 of 61 on the Hub, 3 here),
    not layer 61 as such: a model with more than 61 layers loads its real layer 61."""
    folder = _save(reference(), tmp_path, "per-expert")
    tensors = load_file(folder / "model.safetensors")
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(4, 4), "model.layers.3.enorm.weight": torch.ones(4)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert isinstance(moetune.AutoModelForCausalLM.from_pretrained(folder), DeepseekV3ForCausalLM)

    deep = reference(num_hidden_layers=62, first_k_dense_replace=61, hidden_size=16, intermediate_size=16,
                     moe_intermediate_size=8).eval()  # fmt: skip
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(deep, tmp_path, "deep"))
    torch.testing.assert_close(ours.model.layers[61].mlp.experts.down_proj, deep.model.layers[61].mlp.experts.down_proj)
    ids = parity_batch(deep.config.vocab_size, padded=False)[0]
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, deep(input_ids=ids).logits) < TOL


def _fp8_checkpoint(tmp_path, **overrides):
    """DeepSeek's Hub format (see ``quantize_fp8_checkpoint``), with partial 128-blocks."""
    ref = reference(hidden_size=160, moe_intermediate_size=144, intermediate_size=272, **overrides)
    folder = save_per_expert_checkpoint(ref, tmp_path / "fp8")
    return folder, quantize_fp8_checkpoint(folder)


def test_fp8_block_scaled_weights_are_dequantized_while_loading(tmp_path):
    """The Hub's FP8 DeepSeek-V3 / Kimi-K2 format loads into moetune's model (per-expert tensors into
    the fused experts, partial 128-blocks included) with the values block x scale; the model and
    its saves are plain."""
    folder, expected = _fp8_checkpoint(tmp_path)
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(ours, DeepseekV3ForCausalLM) and getattr(ours.config, "quantization_config", None) is None
    ours.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()
    assert set(expected) <= set(saved)
    for key, values in expected.items():
        torch.testing.assert_close(saved[key], values, rtol=0, atol=0, msg=key)


def test_other_quantized_checkpoints_load_through_transformers_with_a_warning(tmp_path, monkeypatch):
    folder = _save(reference(), tmp_path, "per-expert")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: calls.append(k) or "hf")
    with pytest.warns(UserWarning, match="quant_method='bitsandbytes'.*loads through Transformers' class"):
        assert moetune.AutoModelForCausalLM.from_pretrained(folder) == "hf"
    assert calls and calls[0]["config"].model_type == "deepseek_v3"
    with pytest.raises(ValueError, match="ep_size / device_mesh need an architecture moetune implements"):
        moetune.AutoModelForCausalLM.from_pretrained(folder, ep_size=2)


def test_kimi_k2_configs_load_as_deepseek_v3_without_remote_code(tmp_path):
    """Kimi-K2's Hub config names model_type kimi_k2 with an auto_map to remote code; its fields are
    DeepSeek-V3's, so moetune builds Transformers' DeepseekV3Config and saves a plain checkpoint."""
    ref = reference()
    folder = _save(ref, tmp_path, "per-expert")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (folder / "config.json").write_text(json.dumps(config))
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(ours, DeepseekV3ForCausalLM) and ours.config.model_type == "deepseek_v3"
    check_training_parity(ours, ref, padded=False)
    # Kimi-K2's model card loads it with trust_remote_code=True: moetune's implementation still, with no
    # remote code run (the folder holds none: its config class is never imported).
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(ours).__module__.startswith("moetune.") and ours.config.model_type == "deepseek_v3"
    ref.zero_grad(set_to_none=True)
    check_training_parity(ours, ref, padded=False)


def test_a_kimi_k2_config_object_builds_moetunes_deepseek_v3():
    """A config built by Kimi-K2's remote code (model_type kimi_k2, DeepSeek-V3's fields) gets moetune's
    implementation from from_config too."""
    remote = tiny_deepseek_v3_config()
    remote.model_type = "kimi_k2"  # what the remote config class says; its fields are DeepSeek-V3's
    model = moetune.AutoModelForCausalLM.from_config(remote)
    assert type(model).__module__.startswith("moetune.") and model.config.model_type == "deepseek_v3"
    assert model.config.n_routed_experts == remote.n_routed_experts and model.config.vocab_size == remote.vocab_size


def test_bad_group_settings_name_the_fields():
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        moetune.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(n_group=3, topk_group=1))


@pytest.mark.distributed
def test_expert_parallel_two_processes_equal_one_process(tmp_path):
    """ep=2 under gloo: SGD steps with clipping and an AdamW step equal one process; the gathered
    save equals the single-process save (tests/distributed/workers.py:train_parity)."""
    from tests.distributed import workers
    from tests.distributed.helpers import spawn

    folder = save_per_expert_checkpoint(reference(vocab_size=64), tmp_path / "ckpt")
    # This model's first loss is already ln(64), the entropy of the random tokens the steps train
    # on, so only the parity is checked, not that the loss goes down.
    spawn(workers.train_parity, 2, str(folder), 2, str(tmp_path / "out"), True, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts_backend", ["auto", "quack"])
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers(tmp_path, experts_backend):
    """bf16 on CUDA (grouped GEMM experts, fused kernels, fp32 router): loss and gradients within
    the brief's 1e-2 of Transformers in fp32 holding the same weights, and no further than
    Transformers' own bf16 model."""
    folder = _save(reference(hidden_size=64, moe_intermediate_size=32, intermediate_size=96), tmp_path, "per-expert")
    check_bf16_training_parity(folder, vocab=96, experts_backend=experts_backend)


@pytest.mark.distributed
def test_fp8_under_expert_parallelism_reads_each_ranks_blocks(tmp_path):
    """ep=2: each rank dequantizes only its experts and its FSDP2 rows (row ranges that split the
    128-blocks), and trains like one process."""
    from tests.distributed import workers
    from tests.distributed.helpers import spawn

    folder, _ = _fp8_checkpoint(tmp_path, vocab_size=64)
    spawn(workers.train_parity, 2, str(folder), 2, str(tmp_path / "out"), True, False)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "q_proj"])
def test_packed_rows_with_offsets_equal_each_document_alone(tmp_path, q_lora_rank):
    """Packed rows with their documents' offsets (what the recipe passes): the latent attention
    stays inside each document (values narrower than queries: the masked SDPA path), and
    Transformers prepares no mask."""
    ref = reference(q_lora_rank=q_lora_rank)
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "per-expert"))
    assert ours.model.takes_document_offsets
    check_packed_documents_parity(ours, ref)


def test_values_padded_to_the_query_width_give_the_same_training(tmp_path, monkeypatch):
    """Where torch's flash / cuDNN kernels run (CUDA, half precision) the values are zero-padded to
    the query / key width and the output sliced back. Forced here on CPU in fp32: the plain causal
    path and the packed path still equal Transformers (logits, loss, every gradient)."""
    import moetune.models.deepseek_v3.model as deepseek

    widths = []

    def pad_everywhere(q):
        widths.append(q.shape[-1])
        return True

    monkeypatch.setattr(deepseek, "flash_kernels_apply", pad_everywhere)
    ref = reference()
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "fused"))
    check_training_parity(ours, ref, padded=False)
    ours.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    check_packed_documents_parity(ours, ref)
    assert widths and set(widths) == {ref.config.qk_nope_head_dim + ref.config.qk_rope_head_dim}
