"""The FP8 linear layers' autograd Functions: a dense ``x W^T`` and the experts' grouped ``x W_e^T``.

Each of the three GEMMs of a linear layer runs in e4m3 with its operands scaled along its own
contraction dimension (``moetune.kernels.fp8_quantize``):

| GEMM | contraction | activations / gradients | weight |
|---|---|---|---|
| forward ``y = x W^T`` | in-features | ``x`` by rows (rowwise) or 1 x 128 slices | ``W`` by rows, or 128 x 128 tiles |
| input gradient ``dx = dy W`` | out-features | ``dy`` by rows, or 1 x 128 slices | ``W^T`` by rows, or 128 x 128 tiles |
| weight gradient ``dW = dy^T x`` | tokens (of each expert) | ``dy`` and ``x`` by columns, or 128-token slices | - |

Scales are computed on the device every time (dynamic scaling, no amax history, no host sync), so
the step stays CUDA-graph capturable and the bf16 master weights are all there is to save. The
weights are quantised from them in each forward and again, in the input gradient's layout, in the
backward: nothing FP8 outlives the step.

What is saved for the backward: the input in bf16 where another consumer keeps it anyway (a dense
layer's input, read by its sibling projections or the attention; the experts' tokens before the
gather, read by the router); where the layer alone keeps it (the experts' second GEMM reads the
activation's output, N = tokens x top-k rows), its e4m3 values and scales instead, half the bytes.

Shape legend: T tokens, N routed rows sorted by expert, K in-features, O out-features, E experts.
"""

from __future__ import annotations

import functools

import torch

from moetune.fp8.gemm import rows_mm, weight_grad
from moetune.fp8.settings import Fp8Settings, check_fp8_hardware
from moetune.kernels.fp8_grouped_gemm import _dequantize_along
from moetune.kernels.fp8_quantize import FP8_DTYPE, column_layout, quantize_blocks, quantize_columns, quantize_rows
from moetune.kernels.grouped_gemm import grouped_mm, grouped_mm_supported, grouped_weight_grad_reference
from moetune.kernels.permute import permute_rows, permute_rows_backward


def quantize_weight(w_EOK: torch.Tensor, settings: Fp8Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight [E, O, K] (or a transposed view) as ``rows_mm`` takes it: per row (scales [E, O, 1])
    or per 128 x 128 tile."""
    if settings.blockwise:
        return quantize_blocks(w_EOK, impl=settings.impl)
    return quantize_rows(w_EOK, impl=settings.impl)


def _without_autocast(function):
    """The GEMMs here pick their own precisions: autocast must not recast the reference's fp32
    matmuls (the callers cast the activations as autocast would, once, before)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return function(*args, **kwargs)

    return wrapper


def _check_device(*tensors: torch.Tensor, settings: Fp8Settings) -> None:
    if settings.backend != "reference" and not all(t.is_cuda for t in tensors):
        check_fp8_hardware(settings, tensors[0].device)


def _gather_rows(q_TK: torch.Tensor, scale_TB: torch.Tensor, order_N: torch.Tensor, top_k: int):
    """Rows ``order_N // top_k`` of quantised rows and their scales (a row's scales travel with it)."""
    source = torch.div(order_N, top_k, rounding_mode="floor")
    gathered = q_TK.view(torch.uint8).index_select(0, source).view(FP8_DTYPE)
    return gathered, scale_TB.index_select(0, source)


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """``rows_N @ w_EOK[e]^T`` per expert group in FP8, rows ``x[order_N // top_k]`` (or ``x``);
    rows past ``offsets_E[-1]`` are padding (their outputs undefined, their gradients skipped)."""

    @staticmethod
    @_without_autocast
    def forward(ctx, x, w_EOK, order_N, offsets_E, top_k: int, settings: Fp8Settings):
        _check_device(x, w_EOK, settings=settings)
        q, scale = quantize_rows(x, block=settings.block, impl=settings.impl)
        if order_N is not None:  # quantising before the gather: T rows instead of T x top_k, same values
            q, scale = _gather_rows(q, scale, order_N, top_k)
        w_q, w_scale = quantize_weight(w_EOK, settings)
        y = rows_mm(q, scale, w_q, w_scale, offsets_E, settings=settings, out_dtype=x.dtype, fast_accum=not settings.blockwise)
        # The gathered tokens' source x is kept by the router anyway; ungathered rows only by this layer
        # (in e4m3, unless the weight gradient takes them as they came).
        keep_input = order_N is not None or settings.weight_grad == "bf16"
        saved = (x, None, None) if keep_input else (None, q, scale)
        ctx.save_for_backward(*saved, w_EOK, order_N, offsets_E)
        ctx.top_k, ctx.settings, ctx.x_dtype = top_k, settings, x.dtype
        return y

    @staticmethod
    @_without_autocast
    def backward(ctx, dy_NO):
        x, x_q, x_scale, w_EOK, order_N, offsets_E = ctx.saved_tensors
        settings = ctx.settings
        dy_NO = dy_NO.contiguous()
        num_valid = offsets_E[-1:]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_scale = quantize_rows(dy_NO, block=settings.block, impl=settings.impl)
            wt_q, wt_scale = quantize_weight(w_EOK.transpose(-2, -1), settings)
            dx = rows_mm(dy_q, dy_scale, wt_q, wt_scale, offsets_E, settings=settings, out_dtype=ctx.x_dtype)
            # The e4m3 copy of the weight (half its bf16 bytes) must not outlive its GEMM: the weight
            # gradient allocated next is the backward's largest tensor, and the two together set its peak.
            del dy_q, dy_scale, wt_q, wt_scale
            if order_N is not None:
                dx = permute_rows_backward(dx, order_N, ctx.top_k, num_valid=num_valid, impl=settings.impl)
        if ctx.needs_input_grad[1]:
            if order_N is not None:
                rows = permute_rows(x, order_N, ctx.top_k, num_valid=num_valid, impl=settings.impl)
            elif x is not None:
                rows = x
            else:
                rows = _dequantize_along(x_q, x_scale, 1).to(ctx.x_dtype)
            dw = _weight_grad(dy_NO, rows, offsets_E, settings=settings, out_dtype=w_EOK.dtype, dense=False)
        return dx, dw, None, None, None, None


class Fp8LinearFunction(torch.autograd.Function):
    """``x_TK @ w_OK^T`` in FP8 (no bias: added outside, where autograd sums its gradient)."""

    @staticmethod
    @_without_autocast
    def forward(ctx, x_TK, w_OK, settings: Fp8Settings):
        _check_device(x_TK, w_OK, settings=settings)
        q, scale = quantize_rows(x_TK, block=settings.block, impl=settings.impl)
        w_q, w_scale = quantize_weight(w_OK.unsqueeze(0), settings)
        y = rows_mm(q, scale, w_q, w_scale, None, settings=settings, out_dtype=x_TK.dtype, fast_accum=not settings.blockwise)
        ctx.save_for_backward(x_TK, w_OK)
        ctx.settings = settings
        return y

    @staticmethod
    @_without_autocast
    def backward(ctx, dy_TO):
        x_TK, w_OK = ctx.saved_tensors
        settings = ctx.settings
        dy_TO = dy_TO.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q, dy_scale = quantize_rows(dy_TO, block=settings.block, impl=settings.impl)
            wt_q, wt_scale = quantize_weight(w_OK.t().unsqueeze(0), settings)
            dx = rows_mm(dy_q, dy_scale, wt_q, wt_scale, None, settings=settings, out_dtype=x_TK.dtype)
            del dy_q, dy_scale, wt_q, wt_scale  # as in the grouped backward: freed before the weight gradient
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(dy_TO, x_TK, None, settings=settings, out_dtype=w_OK.dtype, dense=True)[0]
        return dx, dw, None


def _weight_grad(dy_NO, x_NK, offsets_E, *, settings: Fp8Settings, out_dtype: torch.dtype, dense: bool) -> torch.Tensor:
    """[E, O, K]: each group's ``dy^T x``, both quantised along the tokens (on one ``column_layout``), or
    with ``weight_grad="bf16"`` from the operands as they are (fp32 accumulation)."""
    if settings.weight_grad == "bf16":
        return _unquantised_weight_grad(dy_NO, x_NK.to(dy_NO.dtype), offsets_E, settings=settings).to(out_dtype)
    if offsets_E is None:
        offsets_E = torch.full((1,), x_NK.shape[0], dtype=torch.int32, device=x_NK.device)
    layout = column_layout(offsets_E)
    dy_q, dy_scale, padded_E = quantize_columns(dy_NO, offsets_E, block=settings.block, impl=settings.impl, layout=layout)
    x_q, x_scale, _ = quantize_columns(x_NK, offsets_E, block=settings.block, impl=settings.impl, layout=layout)
    return weight_grad(dy_q, dy_scale, x_q, x_scale, padded_E, layout[1], num_rows=x_NK.shape[0], dense=dense,
                       settings=settings, out_dtype=out_dtype)  # fmt: skip


def _unquantised_weight_grad(dy_NO, x_NK, offsets_E, *, settings: Fp8Settings) -> torch.Tensor:
    """[E, O, K] (one group for a dense layer): ``dy^T x`` per group in the operands' dtype with fp32
    accumulation (torch's GEMMs on CUDA; the reference loop in fp32 for the reference backend)."""
    if offsets_E is None:
        if settings.backend == "reference":
            dy_NO, x_NK = dy_NO.float(), x_NK.float()
        return (dy_NO.t() @ x_NK).unsqueeze(0)
    if settings.backend != "reference" and grouped_mm_supported(x_NK):
        return grouped_mm(dy_NO.t(), x_NK, offs=offsets_E)
    return grouped_weight_grad_reference(dy_NO, x_NK, offsets_E)


def fp8_grouped_linear(
    x: torch.Tensor, w_EOK: torch.Tensor, offsets_E: torch.Tensor, *, settings: Fp8Settings,
    gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> torch.Tensor:  # fmt: skip
    """The experts' ``rows @ W_e^T`` in FP8 (``moetune.moe.run_experts`` with ``fp8``)."""
    return Fp8GroupedLinearFunction.apply(x, w_EOK, gather_order, offsets_E, top_k, settings)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, settings: Fp8Settings) -> torch.Tensor:
    """``F.linear`` in FP8: ``x [..., K] @ weight [O, K]^T (+ bias)``."""
    y = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, settings).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
