"""``F.linear(x.float(), w.float())`` for bf16 activations and an fp32 weight, on bf16 tensor cores.

Why: DeepSeek-V3's router (and Nemotron-H's, the same class) computes its logits in fp32 from an
fp32 weight, as Transformers does. An fp32 GEMM runs on the GPU's SIMT units (~50 TFLOP/s on an
H100/H200, against ~700 for bf16 tensor cores), and at DeepSeek-V3's shapes (4096 tokens x 256
experts x 7168) its forward and two backward GEMMs take ~0.8 ms per layer.

How, without giving up fp32: the weight splits exactly into three bf16 parts (hi + mid + lo: 8
significant bits each, fp32 has 24), and a bf16 activation times a bf16 part is exact in fp32, so
one GEMM of x against the three stacked parts with fp32 accumulation (cuBLAS's bf16 -> fp32
``torch.mm(..., out_dtype=torch.float32)``) gives the fp32 logits up to the order of the fp32
additions. The weight's gradient (fp32) splits the incoming fp32 gradient in three the same way;
the activations' gradient, rounded to bf16 at the end, takes two parts of each factor (relative
error ~2^-16 before that rounding).

Shape legend: T rows, H input features, E output features (experts).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _has_mm_out_dtype() -> bool:
    return hasattr(torch.ops.aten.mm, "dtype")  # cuBLAS's bf16 x bf16 -> fp32 GEMM (CUDA only)


def split_bf16(t: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, *t.shape] bf16 whose sum is ``t`` (fp32): exactly for 3 parts (barring subnormals),
    to ~2^-17 relative for 2."""
    pieces, rest = [], t.float()
    for _ in range(parts):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.float()  # exact: the rounding error of a float is a float
    return torch.stack(pieces)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 a @ bf16 b with fp32 accumulation and output (the same values on CPU, through fp32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def fp32_linear(x_TH: torch.Tensor, w_EH: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``F.linear(x.float(), w.float())`` [T, E] in fp32. ``impl``: ``"split"`` (the bf16 parts above),
    ``"torch"`` (that expression), ``"auto"`` (split for bf16 ``x`` and fp32 ``w`` on CUDA, else torch)."""
    if impl not in ("auto", "split", "torch"):
        raise ValueError(f"impl must be 'auto', 'split' or 'torch', got {impl!r}")
    splittable = x_TH.dtype == torch.bfloat16 and w_EH.dtype == torch.float32 and x_TH.dim() == 2
    if impl == "split" and not splittable:
        raise ValueError(f"impl='split' takes 2-D bf16 rows and an fp32 weight, got {x_TH.dtype} {tuple(x_TH.shape)} "
                         f"and {w_EH.dtype}")
    if impl == "torch" or (impl == "auto" and not (splittable and x_TH.is_cuda and _has_mm_out_dtype())):
        return F.linear(x_TH.float(), w_EH.float())
    return _SplitBf16Linear.apply(x_TH, w_EH)


class _SplitBf16Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)  # the parameter and the activations: nothing new kept
        num_experts = w_EH.shape[0]
        parts_3EH = split_bf16(w_EH, 3).flatten(0, 1)
        logits_T3E = _mm_fp32(x_TH, parts_3EH.t()).view(-1, 3, num_experts)
        return (logits_T3E[:, 2] + logits_T3E[:, 1]) + logits_T3E[:, 0]  # the small parts first

    @staticmethod
    def backward(ctx, grad_TE):
        x_TH, w_EH = ctx.saved_tensors
        grad_TE = grad_TE.float()
        dx_TH = dw_EH = None
        if ctx.needs_input_grad[0]:
            # (g_hi + g_lo)(w_hi + w_lo) less g_lo w_lo, as one GEMM over a 3E-long reduction.
            g_hi, g_lo = split_bf16(grad_TE, 2)
            w_hi, w_lo = split_bf16(w_EH, 2)
            dx_TH = _mm_fp32(torch.cat([g_hi, g_lo, g_hi], dim=1), torch.cat([w_hi, w_hi, w_lo])).to(x_TH.dtype)
        if ctx.needs_input_grad[1]:
            g_3TE = split_bf16(grad_TE, 3)
            dw_3EH = _mm_fp32(g_3TE.permute(0, 2, 1).flatten(0, 1), x_TH).view(3, -1, x_TH.shape[1])
            dw_EH = (dw_3EH[2] + dw_3EH[1]) + dw_3EH[0]
        return dx_TH, dw_EH
