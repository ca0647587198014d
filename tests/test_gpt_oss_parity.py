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
    check_bf16_cuda_training_parity,
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
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers(tmp_path):
    """bf16 on CUDA (grouped GEMMs with per-expert biases): loss and gradients within 1e-2 of
    Transformers in fp32 holding the same weights, or no further than Transformers' bf16."""
    folder = save_with_transformers(reference(hidden_size=64, intermediate_size=32), tmp_path)
    check_bf16_cuda_training_parity(folder, vocab=96)
