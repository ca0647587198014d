"""moetune's Nemotron-H (Nemotron 3 Nano's architecture) equals Transformers' on tiny fp32 hybrid
configs (Mamba-2, attention, MoE with and without the latent projection): logits, loss, gradients,
generation; Hub-style files (``backbone.`` prefix, per-expert tensors) load; plain Transformers
loads what moetune saves; expert parallelism equals one process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from transformers.models.nemotron_h import modeling_nemotron_h

import moetune
from moetune.models.nemotron_h.model import NemotronHForCausalLM, NemotronHMoEBlock
from tests.conftest import (
    check_bf16_training_parity,
    check_packed_documents_parity,
    check_generation_and_reload,
    check_training_parity,
    save_with_transformers,
    seeded_reference,
)

TOL = 1e-5
CONFIGS = {
    "mamba-moe-attention-moe": {},
    "latent-moe": {"moe_latent_size": 16, "hybrid_override_pattern": "E*ME"},
}


# Transformers 5.10's inline torch Mamba-2 scan sums the states passed between chunks over the
# wrong axis (moetune's scan equals the exact recurrence: tests/test_mamba2_layers.py); with it the
# parity configs keep every sequence in one chunk.
_MULTI_CHUNK = hasattr(modeling_nemotron_h, "mamba2_chunk_scan")


def tiny_nemotron_h_config(**overrides) -> transformers.NemotronHConfig:
    settings = {
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "hybrid_override_pattern": "ME*E", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "chunk_size": 8 if _MULTI_CHUNK else 64,
        "conv_kernel": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0,
        "norm_topk_prob": True, "tie_word_embeddings": False,
    }  # fmt: skip
    settings.update(overrides)
    return transformers.NemotronHConfig(**settings)


def reference(**overrides) -> transformers.NemotronHForCausalLM:
    """Random fp32 weights and a non-zero score-correction bias."""
    return seeded_reference(
        transformers.NemotronHForCausalLM, tiny_nemotron_h_config(**overrides), randomized_suffixes=("e_score_correction_bias",)
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("padded", [False, True])
def test_forward_backward_parity(tmp_path, name, padded):
    ref = reference(**CONFIGS[name])
    ours = moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path))
    assert isinstance(ours, NemotronHForCausalLM)
    assert sum(isinstance(m, NemotronHMoEBlock) for m in ours.modules()) == 2
    check_training_parity(ours, ref, padded=padded)

def test_greedy_generation_and_plain_transformers_reload(tmp_path):
    ref = reference()
    check_generation_and_reload(moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path)), ref, tmp_path)

@pytest.mark.distributed
def test_expert_parallel_two_processes_equal_one_process(tmp_path):
    """ep=2 under gloo (Mamba-2 and attention mixers FSDP2-sharded): SGD + clipping and AdamW equal
    one process; the gathered save equals the single-process save."""
    from tests.distributed import workers
    from tests.distributed.helpers import spawn

    folder = save_with_transformers(reference(vocab_size=64), tmp_path)
    spawn(workers.train_parity, 2, str(folder), 2, str(tmp_path / "out"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts_backend", ["auto", "quack"])
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers(tmp_path, experts_backend):
    folder = save_with_transformers(reference(hidden_size=64, moe_intermediate_size=32), tmp_path)
    check_bf16_training_parity(folder, vocab=96, experts_backend=experts_backend)


@pytest.mark.parametrize("offsets", [False, True], ids=["position_ids", "offsets"])
def test_packed_documents_stay_apart_in_the_mamba_layers(tmp_path, monkeypatch, offsets):
    """Packed rows: each document equals itself run alone in Transformers, which would carry the
    Mamba-2 state from one document into the next if given the packed row. With the documents'
    offsets too, moetune's decoder loop runs: no mask is prepared, and the attention layers stay
    inside each document by the offsets."""
    ref = reference()
    ours = moetune.AutoModelForCausalLM.from_pretrained(save_with_transformers(ref, tmp_path))
    assert ours.keeps_packed_documents_apart and ours.model.takes_document_offsets
    context = (lambda: _no_mask_preparation(monkeypatch)) if offsets else contextlib.nullcontext
    check_packed_documents_parity(ours, ref, offsets=offsets, forward_context=context)


@contextlib.contextmanager
def _no_mask_preparation(monkeypatch):
    from transformers.models.nemotron_h import modeling_nemotron_h

    def no_masks(*args, **kwargs):
        raise AssertionError("packed rows with their offsets must not build masks")

    with monkeypatch.context() as patch:
        for name in ("create_causal_mask", "create_recurrent_attention_mask"):
            if hasattr(modeling_nemotron_h, name):
                patch.setattr(modeling_nemotron_h, name, no_masks)
        yield
