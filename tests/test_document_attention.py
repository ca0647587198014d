"""Packed documents with known offsets (moetune.layers.document_attention): the attention equals a
plain per-document causal reference, and moetune's Qwen3-MoE given the offsets equals
Transformers' on the same packed rows (where Transformers derives the mask from position_ids),
without preparing a mask."""

from __future__ import annotations

import itertools

import pytest
import torch

import moetune
from moetune.layers.document_attention import (
    document_causal_attention,
    document_causal_mask,
    document_offsets,
    offsets_from_positions,
)
from tests.conftest import check_fused_loss_and_gradients, family_reference, forbid_qwen3_mask_preparation, rel_err

TOL = 1e-5
LENGTHS = [[5, 9, 2], [16], [1, 3, 12]]  # three rows of 16 tokens


def _reference(q_BSHD, k_BSKD, v_BSKD, lengths_per_row, scaling):
    """Each document on its own through SDPA's causal kernel (GQA by repetition)."""
    groups = q_BSHD.shape[2] // k_BSKD.shape[2]
    out = torch.empty_like(q_BSHD)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for n in lengths:
            q = q_BSHD[row, start:start + n].transpose(0, 1)
            k = k_BSKD[row, start:start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
            v = v_BSKD[row, start:start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
            out[row, start:start + n] = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling).transpose(0, 1)
            start += n
    return out


@pytest.mark.parametrize("padded_offsets", [None, 12])
def test_attention_stays_inside_each_document(padded_offsets):
    torch.manual_seed(0)
    q = torch.randn(3, 16, 4, 8, requires_grad=True)
    k = torch.randn(3, 16, 2, 8, requires_grad=True)
    v = torch.randn(3, 16, 2, 8, requires_grad=True)
    offsets = document_offsets(LENGTHS, row_length=16, num_offsets=padded_offsets)
    got = document_causal_attention(q, k, v, offsets, max_length=16, scaling=0.3)
    expected = _reference(q, k, v, LENGTHS, 0.3)
    assert rel_err(got, expected) < TOL
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, e in zip(grads, expected_grads):
        assert rel_err(g, e) < TOL


def test_mask_and_offsets_checks():
    offsets = document_offsets([[2, 2]], row_length=4)
    assert offsets.tolist() == [0, 2, 4] and offsets.dtype == torch.int32
    mask = document_causal_mask(offsets, batch=1, seq_len=4)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert document_offsets([[2, 2]], row_length=4, num_offsets=5).tolist() == [0, 2, 4, 4, 4]
    with pytest.raises(ValueError, match="sum to 4"):
        document_offsets([[2, 1]], row_length=4)
    with pytest.raises(ValueError, match="do not fit"):
        document_offsets([[1, 1, 2]], row_length=4, num_offsets=3)


def _packed_batch(vocab_size: int):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab_size, (len(LENGTHS), 16))
    positions = torch.tensor([[p for n in row for p in range(n)] for row in LENGTHS])
    labels = ids.clone()
    labels[positions == 0] = -100  # no label across a boundary
    return ids, positions, labels


def test_qwen3_moe_with_offsets_equals_transformers_packed(reference_qwen3_moe, tmp_path, monkeypatch):
    ref = reference_qwen3_moe()
    ref.save_pretrained(tmp_path, save_original_format=False)
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    ref.train()
    ours.train()
    ids, positions, labels = _packed_batch(ref.config.vocab_size)
    expected = ref(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
    forbid_qwen3_mask_preparation(monkeypatch, "with document offsets no mask is prepared")
    offsets = document_offsets(LENGTHS, row_length=16, num_offsets=10)
    inputs = {"input_ids": ids, "position_ids": positions, "labels": labels, "cu_seq_lens_q": offsets,
              "cu_seq_lens_k": offsets, "max_length_q": 16, "max_length_k": 16}
    with torch.no_grad():
        got = ours(**inputs, return_logits=True)
    assert rel_err(got.logits, expected.logits) < TOL
    assert rel_err(got.loss, expected.loss) < TOL
    assert rel_err(got.aux_loss, expected.aux_loss) < TOL
    check_fused_loss_and_gradients(ours, ref, expected.loss, TOL, **inputs)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h"])
def test_packed_positions_alone_keep_the_documents_apart(family, tmp_path, monkeypatch):
    """Packed rows given by their position_ids alone (TRL's packing under SDPA): moetune finds the
    documents in the positions and runs each as if it were alone, which is what Transformers' model
    gives on every document separately. (Transformers' own packed path agrees for Qwen3-MoE,
    DeepSeek-V3 and Nemotron-H; its GPT-OSS lets the documents attend to each other.)"""
    from moetune.models import causal_lm

    found = []
    monkeypatch.setattr(causal_lm, "offsets_from_positions", lambda p: found.append(offsets_from_positions(p)) or found[-1])
    ref = family_reference(family)
    ref.config.use_cache = False
    ref.save_pretrained(tmp_path, save_original_format=False)
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    ref.eval()
    ours.eval()
    ids, positions, _ = _packed_batch(ref.config.vocab_size)
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=positions).logits
        alone = [
            ref(input_ids=ids[row : row + 1, start : start + n]).logits
            for row, lengths in enumerate(LENGTHS)
            for start, n in zip(itertools.accumulate([0, *lengths[:-1]]), lengths)
        ]
    expected = torch.cat(alone, dim=1).view_as(got)
    assert found and found[0] is not None, "the documents were not found in the positions"
    assert found[0][0].tolist() == document_offsets(LENGTHS, row_length=16).tolist()
    assert rel_err(got, expected) < TOL


def test_positions_that_are_not_packed_documents_find_none():
    assert offsets_from_positions(torch.arange(8)[None] + 1) is None  # not starting at 0
    assert offsets_from_positions(torch.tensor([[0, 1, 2, 4, 0, 1]])) is None  # a skipped position
    offsets, longest = offsets_from_positions(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]))
    assert offsets.tolist() == [0, 3, 5, 6, 12] and longest == 6


def test_offsets_must_be_one_dimensional(reference_qwen3_moe, tmp_path):
    ref = reference_qwen3_moe()
    ref.save_pretrained(tmp_path, save_original_format=False)
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, positions, _ = _packed_batch(ref.config.vocab_size)
    with pytest.raises(ValueError, match="cu_seq_lens_q must be a 1-D tensor"):
        ours(input_ids=ids, position_ids=positions, cu_seq_lens_q=torch.zeros(2, 2, dtype=torch.int32), use_cache=False)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's varlen flash kernel)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [(32, 4), (8, 8)])
def test_varlen_kernel_in_bf16_equals_the_fp32_reference(heads):
    """Qwen3-30B-A3B's attention shape (GQA 32 / 4, head dim 128): the variable-length flash kernel,
    padded offsets and a CUDA-graph replay, against the per-document fp32 reference."""
    from moetune.layers.document_attention import _varlen_kernel

    assert _varlen_kernel() is not None, "torch >= 2.10 has torch.nn.attention.varlen"
    H, K = heads
    lengths = [[700, 1300, 1, 2095], [4096]]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4096, n, 128, device="cuda", requires_grad=True) for n in (H, K, K))
    expected = _reference(q, k, v, lengths, 128**-0.5)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    offsets = document_offsets(lengths, row_length=4096, num_offsets=16).cuda()
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    got = document_causal_attention(qb, kb, vb, offsets, max_length=4096, scaling=128**-0.5)
    assert rel_err(got.float(), expected) < 1e-2
    for g, e in zip(torch.autograd.grad(got, (qb, kb, vb), grad_out.bfloat16()), expected_grads):
        assert rel_err(g.float(), e) < 1e-2
    # Captured and replayed: no host synchronisation in the forward.
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        document_causal_attention(qb, kb, vb, offsets, max_length=4096, scaling=128**-0.5)  # warm-up
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            replayed = document_causal_attention(qb, kb, vb, offsets, max_length=4096, scaling=128**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got.detach())


@pytest.mark.gpu
@needs_cuda
def test_qwen3_moe_with_offsets_in_bf16_on_gpu(reference_qwen3_moe, tmp_path):
    """The whole model in bf16 on the GPU given the offsets (varlen kernel) against Transformers in
    fp32 on the same packed rows (mask from position_ids): loss within 1e-2, each gradient within
    1e-2 or no further than Transformers' own bf16 model's (the brief's bf16 bar)."""
    import transformers

    ref = reference_qwen3_moe()
    ref.save_pretrained(tmp_path, save_original_format=False)
    ref = ref.cuda().train()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().train()
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda").train()
    ids, positions, labels = (t.cuda() for t in _packed_batch(ref.config.vocab_size))
    offsets = document_offsets(LENGTHS, row_length=16).cuda()
    losses = {}
    for name, model, extra in (("ref", ref, {}), ("hf", hf_bf16, {}),
                               ("ours", ours, {"cu_seq_lens_q": offsets, "max_length_q": 16})):
        losses[name] = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False, **extra).loss
        losses[name].backward()
    assert rel_err(losses["ours"].float(), losses["ref"]) < 1e-2
    ref_params, hf_params = dict(ref.named_parameters()), dict(hf_bf16.named_parameters())
    for name, param in ours.named_parameters():
        err = rel_err(param.grad.float(), ref_params[name].grad)
        assert err < max(1e-2, 2 * rel_err(hf_params[name].grad.float(), ref_params[name].grad)), name


def test_transformers_flattening_collator_batches_take_the_document_path(reference_qwen3_moe, tmp_path, monkeypatch):
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (what TRL's padding-free
    training uses) gives moetune's Qwen3-MoE the offsets with SDPA too, not only with
    flash_attention_2: the loss and gradients equal Transformers' on the same flattened row."""
    from transformers import DataCollatorWithFlattening

    ref = reference_qwen3_moe()
    ref.save_pretrained(tmp_path, save_original_format=False)
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    ref.train()
    ours.train()
    torch.manual_seed(2)
    features = [{"input_ids": torch.randint(3, ref.config.vocab_size, (n,)).tolist()} for n in (7, 12, 4)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    expected = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                   use_cache=False)
    forbid_qwen3_mask_preparation(monkeypatch, "with document offsets no mask is prepared")
    check_fused_loss_and_gradients(ours, ref, expected.loss, TOL, **batch)


@pytest.mark.gpu
@needs_cuda
def test_varlen_kernel_under_autocast_with_mixed_input_dtypes():
    """fp32 weights under bf16 autocast (the recipe's default on GPU): projections and norms may
    hand over fp32 and bf16 tensors; the kernel runs in bf16 as SDPA would."""
    torch.manual_seed(0)
    q = torch.randn(1, 64, 4, 32, device="cuda")
    k, v = torch.randn(1, 64, 2, 32, device="cuda").bfloat16(), torch.randn(1, 64, 2, 32, device="cuda").bfloat16()
    offsets = document_offsets([[30, 34]], row_length=64).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = document_causal_attention(q, k, v, offsets, max_length=64, scaling=32**-0.5)
    assert got.dtype == torch.bfloat16
    expected = _reference(q, k.float(), v.float(), [[30, 34]], 32**-0.5)
    assert rel_err(got.float(), expected) < 1e-2


@pytest.mark.parametrize(
    "capability, cudnn, expected",
    [((9, 0), 91900, True), ((10, 0), 91000, True), ((9, 0), 90800, False), ((12, 0), 91900, False), ((8, 0), 91900, False)],
    ids=["hopper", "blackwell-datacenter", "old-cudnn", "blackwell-consumer", "ampere"],
)
def test_narrow_values_go_to_cudnn_only_where_torch_prefers_it(monkeypatch, capability, expected, cudnn):
    """DeepSeek-V3's values stay narrow only where SDPA picks cuDNN's kernel for them; elsewhere
    they are padded for the flash kernel (SDPA would take the slow memory-efficient one)."""
    import moetune.layers.document_attention as attention

    monkeypatch.setattr(attention, "flash_kernels_apply", lambda q: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    assert attention.cudnn_attention_applies(torch.zeros(1, 2, 4, 192)) is expected
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)  # SDPA then skips cuDNN
    assert attention.cudnn_attention_applies(torch.zeros(1, 2, 4, 192)) is False
