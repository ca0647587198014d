"""FP8 on a GPU with FP8 tensor cores (sm89+): the Triton kernels and torch's FP8 GEMMs equal the
references, the steps never wait on the host and replay from CUDA graphs, and tiny models of the
four families train to within 2% of their bf16 loss.

    python -m pytest tests/fp8 -m gpu -v
"""

from __future__ import annotations

import copy

import pytest
import torch

from moetune.fp8 import Fp8Settings, fp8_grouped_linear, fp8_linear
from moetune.fp8.gemm import rows_mm, weight_grad
from moetune.fp8.settings import fp8_hardware_problem
from moetune.kernels.fp8_grouped_gemm import fp8_rows_mm, fp8_weight_grad
from moetune.kernels.fp8_quantize import column_layout, quantize_blocks, quantize_columns, quantize_rows
from moetune.optim import AdamW
from moetune.training import CUDAGraphTrainStep
from tests.conftest import rel_err
from tests.fp8.helpers import FAMILIES, bf16_and_fp8_models, routed_rows, token_batches, train_losses, wide_range

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(fp8_hardware_problem() is not None, reason=f"needs an FP8 GPU: {fp8_hardware_problem()}"),
]
RECIPES = ("rowwise", "blockwise")
BACKENDS = ("auto", "triton")
# Qwen3-30B-A3B's expert shapes at 512 tokens: hidden 2048, width 768, 128 experts (some empty), top-8.
TOKENS, TOP_K, HIDDEN, WIDTH, EXPERTS = 512, 8, 2048, 768, 128


def _counts(generator: torch.Generator) -> list[int]:
    weights = torch.rand(EXPERTS, generator=generator) ** 3
    weights[::17] = 0  # empty experts
    counts = (weights / weights.sum() * TOKENS * TOP_K).floor().long()
    counts[0] += TOKENS * TOP_K - counts.sum()
    return counts.tolist()


def _equal_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float(), b.float())


@pytest.mark.parametrize("block", [None, 128])
def test_quantizers_equal_their_references_bit_for_bit(block):
    generator = torch.Generator().manual_seed(0)
    x = wide_range(1000, HIDDEN, generator=generator, dtype=torch.bfloat16, device="cuda")
    for t in (x, x[:, :1000], x.t()):
        q, s = quantize_rows(t, block=block)
        q_ref, s_ref = quantize_rows(t, block=block, impl="torch")
        assert _equal_fp8(q, q_ref) and torch.equal(s, s_ref)
    w = wide_range(4, 2 * WIDTH, HIDDEN, generator=generator, dtype=torch.bfloat16, device="cuda")
    for t in (w, w.transpose(-2, -1)):
        q, s = quantize_blocks(t)
        q_ref, s_ref = quantize_blocks(t, impl="torch")
        assert _equal_fp8(q, q_ref) and torch.equal(s, s_ref)
    rows = torch.cat([x, torch.full((24, HIDDEN), float("nan"), dtype=x.dtype, device="cuda")])  # padding rows
    counts = [0, 300, 1, 0, 255, 444]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    q, s, padded = quantize_columns(rows, offsets, block=block)
    q_ref, s_ref, padded_ref = quantize_columns(rows, offsets, block=block, impl="torch")
    used = int(padded_ref[-1])
    blocks = sum(-(-c // 128) for c in counts) if block else len(counts)
    assert torch.equal(padded, padded_ref) and torch.equal(s[:blocks], s_ref[:blocks])
    assert _equal_fp8(q[:, :used], q_ref[:, :used])


@pytest.mark.parametrize("blockwise", [False, True])
def test_triton_gemms_equal_their_references(blockwise):
    generator = torch.Generator().manual_seed(1)
    block = 128 if blockwise else None
    offsets = routed_rows(TOKENS, TOP_K, _counts(generator), generator=generator, device="cuda")[1]
    x = torch.randn(TOKENS * TOP_K, HIDDEN, generator=generator).cuda()
    w = (torch.randn(EXPERTS, WIDTH, HIDDEN, generator=generator) * 0.02).cuda()
    x_q, x_s = quantize_rows(x, block=block)
    w_q, w_s = quantize_blocks(w) if blockwise else quantize_rows(w)
    out = fp8_rows_mm(x_q, x_s, w_q, w_s, offsets, blockwise=blockwise, out_dtype=torch.float32)
    ref = fp8_rows_mm(x_q, x_s, w_q, w_s, offsets, blockwise=blockwise, out_dtype=torch.float32, impl="torch")
    assert rel_err(out, ref) < 2e-3
    dy = torch.randn(TOKENS * TOP_K, WIDTH, generator=generator).cuda()
    p_q, p_s, padded = quantize_columns(dy, offsets, block=block)
    q_q, q_s, _ = quantize_columns(x, offsets, block=block)
    starts = column_layout(offsets)[1]
    out = fp8_weight_grad(p_q, p_s, q_q, q_s, padded, starts, blockwise=blockwise, out_dtype=torch.float32)
    ref = fp8_weight_grad(p_q, p_s, q_q, q_s, padded, starts, blockwise=blockwise, out_dtype=torch.float32, impl="torch")
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("grouped", [False, True])
def test_torch_fp8_gemms_equal_the_references(recipe, grouped):
    """What backend 'auto' runs (cuBLAS ``_scaled_mm``, CUTLASS ``_scaled_grouped_mm``) against the
    reference on the same quantised operands."""
    generator = torch.Generator().manual_seed(2)
    auto, reference = Fp8Settings(recipe, "auto", "fp8"), Fp8Settings(recipe, "reference", "fp8")
    offsets = routed_rows(TOKENS, TOP_K, _counts(generator), generator=generator, device="cuda")[1] if grouped else None
    num_rows = TOKENS * TOP_K if grouped else 1000
    num_experts = EXPERTS if grouped else 1
    x = torch.randn(num_rows, HIDDEN, generator=generator).to("cuda", torch.bfloat16)
    w = (torch.randn(num_experts, 1024, HIDDEN, generator=generator) * 0.02).to("cuda", torch.bfloat16)
    x_q, x_s = quantize_rows(x, block=auto.block)
    w_q, w_s = quantize_blocks(w) if auto.blockwise else quantize_rows(w)
    out, ref = (rows_mm(x_q, x_s, w_q, w_s, offsets, settings=s, out_dtype=torch.bfloat16) for s in (auto, reference))
    valid = num_rows if offsets is None else int(offsets[-1])
    assert rel_err(out[:valid], ref[:valid]) < 5e-3
    dy = torch.randn(num_rows, 1024, generator=generator).to("cuda", torch.bfloat16)
    p_q, p_s, padded = quantize_columns(dy, offsets, block=auto.block)
    q_q, q_s, _ = quantize_columns(x, offsets, block=auto.block)
    starts = column_layout(offsets if grouped else torch.full((1,), num_rows, dtype=torch.int32, device="cuda"))[1]
    out, ref = (
        weight_grad(p_q, p_s, q_q, q_s, padded, starts, num_rows=num_rows, dense=not grouped, settings=s, out_dtype=torch.bfloat16)
        for s in (auto, reference)
    )  # fmt: skip
    assert rel_err(out, ref) < 5e-3


@pytest.mark.parametrize("in_features,out_features", [(2688, 3712), (2816, 2048), (2048, 4096)])
def test_block_scaled_dense_linears_run_at_the_shapes_cublas_refused(in_features, out_features):
    """Nemotron 3 Nano's and Moonlight's shared-expert widths (K-blocks 21 and 22: Triton, which
    torch 2.11's ``_scaled_mm`` refused on 2026-12-07) and Qwen3's q projection (cuBLAS), forward
    and both gradients, against the reference backend."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(512, in_features, generator=generator).to("cuda", torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=generator) * 0.02).to("cuda", torch.bfloat16)
    results = []
    for settings in (Fp8Settings("blockwise", "auto", "fp8"), Fp8Settings("blockwise", "reference", "fp8")):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(x_, w_, None, settings=settings)
        y.float().square().sum().backward()
        results.append((y, x_.grad, w_.grad))
    for name, ours, ref in zip(("y", "dx", "dw"), *results):
        assert rel_err(ours, ref) < 1e-2, name


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_grad", ["fp8", "bf16"])
def test_linears_equal_the_reference_backend_without_host_sync(recipe, backend, weight_grad):
    """Forward and both gradients of the dense and the grouped (gathering) FP8 linears against the
    reference backend, run under ``set_sync_debug_mode('error')``; with FP8 or bf16 weight gradients."""
    generator = torch.Generator().manual_seed(3)
    order, offsets = routed_rows(TOKENS, TOP_K, _counts(generator), generator=generator, device="cuda")
    x = torch.randn(TOKENS, HIDDEN, generator=generator).to("cuda", torch.bfloat16)
    w_dense = (torch.randn(1024, HIDDEN, generator=generator) * 0.02).to("cuda", torch.bfloat16)
    w_experts = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=generator) * 0.02).to("cuda", torch.bfloat16)
    results = {}
    for settings in (Fp8Settings(recipe, backend, weight_grad), Fp8Settings(recipe, "reference", weight_grad)):
        inputs = [t.detach().clone().requires_grad_() for t in (x, w_dense, w_experts)]
        if settings.backend != "reference":
            torch.cuda.set_sync_debug_mode("error")
        try:
            dense = fp8_linear(inputs[0], inputs[1], None, settings=settings)
            grouped = fp8_grouped_linear(inputs[0], inputs[2], offsets, settings=settings, gather_order=order, top_k=TOP_K)
            (dense.float().square().sum() + grouped.float().square().sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[settings.backend] = [dense, grouped, *(t.grad for t in inputs)]
    for name, ours, ref in zip(("dense", "grouped", "dx", "dw", "dw_experts"), results[backend], results["reference"]):
        assert rel_err(ours, ref) < 1e-2, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("weight_grad", ["bf16", "fp8"])
def test_tiny_models_train_within_two_percent_of_bf16(family, recipe, weight_grad):
    bf16, fp8 = bf16_and_fp8_models(family, Fp8Settings(recipe, "auto", weight_grad), device="cuda")
    batches = token_batches(bf16.config.vocab_size, 6, device="cuda", shape=(4, 64))
    bf16_losses, fp8_losses = train_losses(bf16, batches), train_losses(fp8, batches)
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(fp8_losses, bf16_losses)), (fp8_losses, bf16_losses)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_step_replays_from_cuda_graphs(recipe):
    """The captured FP8 step trains as the eager FP8 loop (scales computed on the device)."""
    _, model = bf16_and_fp8_models("qwen3_moe", Fp8Settings(recipe, "auto"), device="cuda")
    reference = copy.deepcopy(model)
    batches = token_batches(model.config.vocab_size, 5, device="cuda", shape=(2, 64))
    step = CUDAGraphTrainStep(model, AdamW(model.parameters(), lr=1e-3, capturable=True))
    graphed = [step(input_ids=ids, labels=ids).item() for ids in batches]
    assert step.captured
    eager = train_losses(reference, batches)
    assert graphed == pytest.approx(eager, rel=1e-2)
