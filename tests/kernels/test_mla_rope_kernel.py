"""DeepSeek-V3's MLA query / key / value assembly: the reference against Transformers' own ops,
the Triton kernels against the reference (forward and every gradient) under the CPU interpreter
and on the GPU."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from kernel_test_utils import bf16_close, fp32_close, gpu, rope_tables
from moetune.kernels.mla_rope import mla_queries_keys_values


def inputs(batch, seq, heads, nope, rope, value, *, dtype=torch.float32, device="cpu"):
    """As the attention makes them: views of the projections' outputs (the shared rotary key is
    the last R columns of kv_a_proj's output, after the latent)."""
    q = torch.randn(batch, seq, heads * (nope + rope), dtype=dtype, device=device).view(batch, seq, heads, nope + rope)
    kv = torch.randn(batch, seq, heads * (nope + value), dtype=dtype, device=device).view(batch, seq, heads, nope + value)
    k_rot = torch.randn(batch, seq, 24 + rope, dtype=dtype, device=device)[..., 24:]
    cos, sin = rope_tables(1, seq, rope, dtype=dtype, device=device, theta=1e4)
    return q, kv, k_rot, cos, sin


def transformers_ops(q, kv, k_rot, cos, sin, *, interleaved):
    """What Transformers' DeepseekV3Attention does with the same tensors ([B, H, S, *] layout)."""
    nope = q.shape[-1] - k_rot.shape[-1]
    q_pass, q_rot = torch.split(q.transpose(1, 2), [nope, k_rot.shape[-1]], dim=-1)
    k_pass, v = torch.split(kv.transpose(1, 2), [nope, kv.shape[-1] - nope], dim=-1)
    rope = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    q_rot, k_rot = rope(q_rot, k_rot.unsqueeze(1), cos, sin)
    k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
    return (torch.cat((q_pass, q_rot), dim=-1).transpose(1, 2), torch.cat((k_pass, k_rot), dim=-1).transpose(1, 2),
            v.transpose(1, 2))  # fmt: skip


@pytest.mark.parametrize("interleaved", [True, False])
def test_reference_equals_transformers_ops_with_gradients(interleaved):
    torch.manual_seed(0)
    tensors = inputs(2, 5, 3, 8, 4, 6)
    leaves = [t.detach().requires_grad_() for t in tensors[:3]]
    ref_leaves = [t.detach().requires_grad_() for t in tensors[:3]]
    ours = mla_queries_keys_values(*leaves, *tensors[3:], interleaved=interleaved, impl="torch")
    theirs = transformers_ops(*ref_leaves, *tensors[3:], interleaved=interleaved)
    grads = [torch.randn(t.shape) for t in theirs]
    for a, b in zip(ours, theirs):
        fp32_close(a, b)
    for a, b in zip(torch.autograd.grad(ours, leaves, grads), torch.autograd.grad(theirs, ref_leaves, grads)):
        fp32_close(a, b)


def _check_triton_vs_reference(tensors, *, interleaved, pad_values, check):
    leaves = [t.detach().requires_grad_() for t in tensors[:3]]
    ref_leaves = [t.detach().requires_grad_() for t in tensors[:3]]
    ours = mla_queries_keys_values(*leaves, *tensors[3:], interleaved=interleaved, pad_values=pad_values, impl="triton")
    ref = mla_queries_keys_values(*ref_leaves, *tensors[3:], interleaved=interleaved, pad_values=pad_values,
                                  impl="torch")  # fmt: skip
    assert "MLAQueriesKeysValues" in type(ours[0].grad_fn).__name__
    if not pad_values:  # the values stay a view of kv_b_proj's output: no copy
        nope = leaves[0].shape[-1] - leaves[2].shape[-1]
        assert ours[2].data_ptr() == leaves[1].data_ptr() + nope * leaves[1].element_size()
    grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device) for t in ref]
    for a, b in zip(ours, ref):
        check(a, b)
    for a, b in zip(torch.autograd.grad(ours, leaves, grads), torch.autograd.grad(ref, ref_leaves, grads)):
        check(a, b)


@pytest.mark.parametrize("interleaved, pad_values", [(True, False), (False, False), (True, True)])
def test_triton_matches_reference_in_interpreter(interpret, interleaved, pad_values):
    """Heads not a power of two and more than one tile of them (DeepSeek-V3 has 128), uneven widths."""
    torch.manual_seed(0)
    tensors = inputs(2, 3, 5, 12, 8, 10)
    _check_triton_vs_reference(tensors, interleaved=interleaved, pad_values=pad_values, check=fp32_close)


def test_shapes_are_checked():
    q, kv, k_rot, cos, sin = inputs(1, 4, 2, 8, 4, 6)
    with pytest.raises(ValueError, match="MLA shapes disagree"):
        mla_queries_keys_values(q, kv[:, :3], k_rot, cos, sin, interleaved=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved, pad_values", [(True, False), (False, True)])
def test_triton_matches_reference_on_gpu(dtype, interleaved, pad_values):
    """Moonlight-16B-A3B's heads (16 of 128 + 64, values 128) at 1024 positions."""
    torch.manual_seed(0)
    tensors = inputs(1, 1024, 16, 128, 64, 128, dtype=dtype, device="cuda")
    check = bf16_close if dtype == torch.bfloat16 else fp32_close
    _check_triton_vs_reference(tensors, interleaved=interleaved, pad_values=pad_values, check=check)


def test_unused_values_get_zero_gradients_in_interpreter(interpret):
    """Autograd hands the backward zeros for an output the loss does not use (here the values)."""
    torch.manual_seed(0)
    tensors = inputs(1, 2, 2, 4, 4, 4)
    leaves = [t.detach().requires_grad_() for t in tensors[:3]]
    q_out, k_out, _ = mla_queries_keys_values(*leaves, *tensors[3:], interleaved=True, impl="triton")
    _, grad_kv, _ = torch.autograd.grad(q_out.sum() + k_out.sum(), leaves)
    assert torch.equal(grad_kv[..., 4:], torch.zeros_like(grad_kv[..., 4:]))
    assert torch.equal(grad_kv[..., :4], torch.ones_like(grad_kv[..., :4]))


@pytest.mark.parametrize("pad_values", [False, True])
def test_deepseek_attention_with_the_kernels_equals_transformers_in_interpreter(interpret, monkeypatch, pad_values):
    """moetune's DeepseekV3Attention taking the kernels' path (as on CUDA; forced here, fp32 on
    CPU): output and every gradient equal Transformers' attention module, with the values as a
    view or zero-padded to the query width (the flash kernels' layout). Values narrower than the
    query heads, a q LoRA, interleaved RoPE."""
    import transformers

    import moetune.models.deepseek_v3.model as deepseek

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=32, rope_scaling=None,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = hf.DeepseekV3Attention(config, layer_idx=0)
    for param in theirs.parameters():  # away from the ones / zeros init, so the norms matter
        param.data.normal_(0, 0.3)
    ours = deepseek.DeepseekV3Attention(config, layer_idx=0)
    ours.load_state_dict(theirs.state_dict())
    calls = []

    def kernels(*args, **kwargs):
        calls.append(kwargs["pad_values"])
        return mla_queries_keys_values(*args, **kwargs, impl="triton")

    monkeypatch.setattr(deepseek, "mla_queries_keys_values", kernels)
    monkeypatch.setattr(deepseek, "flash_kernels_apply", lambda q: pad_values)
    monkeypatch.setattr(deepseek, "cudnn_attention_applies", lambda q: False)
    x = torch.randn(2, 7, 32)
    position_embeddings = hf.DeepseekV3RotaryEmbedding(config)(x, torch.arange(7)[None].expand(2, -1))
    grad_out = torch.randn(2, 7, 32)
    results = []
    for module in (ours, theirs):
        leaf = x.clone().requires_grad_()
        out = module(leaf, position_embeddings, None)[0]
        params = [leaf, *module.parameters()]
        results.append([out, *torch.autograd.grad(out, params, grad_out)])
    assert calls == [pad_values]
    for a, b in zip(*results):
        fp32_close(a, b, atol=1e-5, rtol=1e-5)
