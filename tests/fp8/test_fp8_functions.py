"""The FP8 linears' numerics on CPU (the reference backend): each GEMM is the fp32 product of the
operands quantised along its contraction dimension, within FP8's error of the unquantised product."""

from __future__ import annotations

import pytest
import torch

from moetune.fp8 import Fp8Settings, fp8_grouped_linear, fp8_linear
from moetune.kernels.fp8_quantize import BLOCK, pow2_scale
from tests.conftest import rel_err
from tests.fp8.helpers import grouped_reference, routed_rows, wide_range

RECIPES = ("rowwise", "blockwise")
FP8_REL_ERR = 0.05  # two e4m3 roundings (3 mantissa bits each) per product, averaged over the sum


def _fake_quant(x: torch.Tensor, dim: int, block: int | None) -> torch.Tensor:
    """x quantised along ``dim`` (one scale per slice of ``block`` there, or the whole dimension) and
    dequantised, in fp32: the values the FP8 GEMMs multiply."""
    x = x.float().movedim(dim, -1)
    width = x.shape[-1] if block is None else block
    pad = -x.shape[-1] % width
    tiles = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, width))
    scale = pow2_scale(tiles.abs().amax(-1, keepdim=True))
    out = ((tiles / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).flatten(-2)
    return out[..., : x.shape[-1]].movedim(-1, dim)


def _fake_quant_weight(w: torch.Tensor, contraction_dim: int, settings: Fp8Settings) -> torch.Tensor:
    if not settings.blockwise:
        return _fake_quant(w, contraction_dim, None)
    rows = -(-w.shape[0] // BLOCK) * BLOCK
    cols = -(-w.shape[1] // BLOCK) * BLOCK
    tiles = torch.nn.functional.pad(w.float(), (0, cols - w.shape[1], 0, rows - w.shape[0])).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = pow2_scale(tiles.abs().amax(dim=(1, 3), keepdim=True))
    return ((tiles / scale).to(torch.float8_e4m3fn).float() * scale).reshape(rows, cols)[: w.shape[0], : w.shape[1]]


@pytest.mark.parametrize("recipe", RECIPES)
def test_dense_linear_is_the_product_of_operands_quantised_along_each_contraction(recipe):
    """Forward, input gradient and weight gradient each equal the fp32 product of their operands
    quantised as the recipe says (rows / 1 x 128 slices along the contraction; weights by rows or
    128 x 128 tiles), and are within FP8's error of the unquantised products."""
    settings = Fp8Settings(recipe, "reference", weight_grad="fp8")
    generator = torch.Generator().manual_seed(0)
    x = wide_range(70, 272, generator=generator).requires_grad_()
    w = torch.randn(144, 272, generator=generator).requires_grad_()
    dy = wide_range(70, 144, generator=generator)
    y = fp8_linear(x, w, None, settings=settings)
    y.backward(dy)
    block = settings.block
    expected_y = _fake_quant(x, 1, block) @ _fake_quant_weight(w, 1, settings).t()
    expected_dx = _fake_quant(dy, 1, block) @ _fake_quant_weight(w, 0, settings)
    expected_dw = _fake_quant(dy, 0, block).t() @ _fake_quant(x.detach(), 0, block)
    for ours, expected in ((y, expected_y), (x.grad, expected_dx), (w.grad, expected_dw)):
        assert rel_err(ours, expected) < 1e-6
    exact = (x.detach() @ w.detach().t(), dy @ w.detach(), dy.t() @ x.detach())
    for ours, ideal in zip((y, x.grad, w.grad), exact):
        assert rel_err(ours, ideal) < FP8_REL_ERR


def test_the_recipes_differ_where_one_scale_cannot_hold_the_range():
    """Power-of-two scales leave e4m3's mantissa rounding alone, so the recipes differ only where
    small values of a row underflow its scale: one scale per 128 values keeps more of them."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 512, generator=generator)
    x[:, 256:] *= 2.0**-14  # a quiet half of each row, far below its loud half
    w = torch.eye(512)[256:]  # y = the quiet half
    outputs = {recipe: fp8_linear(x, w, None, settings=Fp8Settings(recipe, "reference")) for recipe in RECIPES}
    assert rel_err(outputs["blockwise"], x[:, 256:]) < FP8_REL_ERR < rel_err(outputs["rowwise"], x[:, 256:])


GROUPED_TOKENS, GROUPED_TOP_K = 40, 2


def _grouped_backward(settings: Fp8Settings, gather: bool, *, seed: int):
    """The experts' FP8 linear on 4 experts (one without rows), forward and backward: with the dispatch
    gather, or on already-sorted rows with 6 padding rows after the last group (their gradient 0).
    Returns (x, w, y, dy, order, offsets)."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, top_k, hidden, out = GROUPED_TOKENS, GROUPED_TOP_K, 160, 48
    order, offsets = routed_rows(num_tokens, top_k, [30, 0, 45, 5], generator=generator)
    rows = num_tokens if gather else num_tokens * top_k + 6
    x = torch.randn(rows, hidden, generator=generator).requires_grad_()
    w = torch.randn(4, out, hidden, generator=generator).requires_grad_()
    y = fp8_grouped_linear(x, w, offsets, settings=settings, gather_order=order if gather else None, top_k=top_k)
    dy = torch.randn(y.shape, generator=generator)
    dy[num_tokens * top_k:] = 0
    y.backward(dy)
    return x, w, y, dy, order, offsets


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_linear_matches_fp32_per_expert_within_fp8_error(recipe, gather):
    """The experts' FP8 GEMMs (with the dispatch gather, or on already-sorted rows with padding rows
    after the last group) against fp32 per-expert products: outputs and both gradients."""
    num_tokens, top_k = GROUPED_TOKENS, GROUPED_TOP_K
    x, w, y, dy, order, offsets = _grouped_backward(Fp8Settings(recipe, "reference", weight_grad="fp8"), gather, seed=2)
    valid = num_tokens * top_k
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = grouped_reference(x_ref, w_ref, order if gather else None, offsets, top_k)
    y_ref.backward(dy[:valid])
    assert rel_err(y[:valid], y_ref) < FP8_REL_ERR
    assert rel_err(w.grad, w_ref.grad) < FP8_REL_ERR and torch.all(w.grad[1] == 0)  # an expert with no rows
    assert rel_err(x.grad[: num_tokens if gather else valid], x_ref.grad[: num_tokens if gather else valid]) < FP8_REL_ERR
    if not gather:
        assert torch.all(x.grad[valid:] == 0)  # padding rows get no gradient


@pytest.mark.parametrize("gather", [True, False])
def test_bf16_weight_gradients_are_the_unquantised_products(gather):
    """``weight_grad="bf16"``: the experts' and the dense layer's weight gradients are ``dy^T x`` of the
    unquantised operands, exactly (fp32 here); forward and input gradient stay FP8's."""
    settings = Fp8Settings("rowwise", "reference", weight_grad="bf16")
    top_k = GROUPED_TOP_K
    x, w, y, dy, order, offsets = _grouped_backward(settings, gather, seed=3)
    valid = GROUPED_TOKENS * top_k
    w_ref = w.detach().clone().requires_grad_()
    grouped_reference(x.detach(), w_ref, order if gather else None, offsets, top_k).backward(dy[:valid])
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    fp8_only = fp8_grouped_linear(x.detach(), w.detach(), offsets, settings=Fp8Settings("rowwise", "reference", weight_grad="fp8"),
                                  gather_order=order if gather else None, top_k=top_k)  # fmt: skip
    torch.testing.assert_close(y.detach(), fp8_only)  # the forward is FP8's either way

    generator = torch.Generator().manual_seed(4)
    dense_x = torch.randn(24, x.shape[1], generator=generator).requires_grad_()
    dense_w = torch.randn(w.shape[1], x.shape[1], generator=generator).requires_grad_()
    dense_dy = torch.randn(24, w.shape[1], generator=generator)
    fp8_linear(dense_x, dense_w, None, settings=settings).backward(dense_dy)
    torch.testing.assert_close(dense_w.grad, dense_dy.t() @ dense_x.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
def test_ungathered_rows_are_kept_for_the_backward_as_the_weight_gradient_reads_them(weight_grad):
    """The experts' second GEMM keeps its input (rows only it reads) as e4m3 values and scales, about half
    the bytes of the bf16 rows autograd would keep; with bf16 weight gradients, which read the rows
    themselves, as they came (as bf16 training does)."""
    settings = Fp8Settings("rowwise", "reference", weight_grad=weight_grad)
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([200, 512], dtype=torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_grouped_linear(x, w, offsets, settings=settings)
    activations = [t for t in saved if t.shape[0] == 512]
    if weight_grad == "bf16":
        assert {t.dtype for t in activations} == {torch.bfloat16}
    else:
        assert {t.dtype for t in activations} == {torch.float8_e4m3fn, torch.float32}
        assert sum(t.numel() * t.element_size() for t in activations) < 0.6 * x.numel() * x.element_size()
