"""Compile every Triton kernel for Hopper (sm_90) on a CPU-only machine, launched exactly as the
dispatchers launch them on Qwen3-30B-A3B shapes.

The interpreter checks the kernels' math but not that Triton's compiler accepts them; this test
runs the real compiler (Triton -> TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas)
without a GPU, by swapping each ``@triton.jit`` kernel for a stub that builds the signature and
constexprs from the launch arguments (as Triton's launcher does) and compiles instead of running.
Results of the stubbed launches are garbage and unused.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (optional, GPU-only dependency): nothing to compile")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces the compiler in this process", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from moetune.kernels import apply_rope, moe_combine, moe_permute, rms_norm, swiglu, swiglu_split  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32",
          torch.float8_e4m3fn: "*fp8e4nv"}
_COMPILED: dict[tuple, object] = {}


def _signature(fn: JITFunction, args: tuple, constexprs: dict) -> tuple[dict, dict, dict]:
    """Types as Triton's launcher infers them: tensors -> pointers (16-byte aligned), ints ->
    i32 / i64 (1 becomes a constexpr, multiples of 16 get the divisibility hint), floats -> fp32."""
    signature, attrs, constants = {}, {}, dict(constexprs)
    for index, (name, value) in enumerate(zip(fn.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constants[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: unexpected argument {name}={value!r}")
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constants, attrs


class _CompileOnly:
    def __init__(self, fn: JITFunction):
        self.fn = fn

    def __getitem__(self, grid):
        assert all(isinstance(g, int) and g > 0 for g in grid), grid
        assert grid[0] < 2**31 and all(g < 65536 for g in grid[1:]), f"grid {grid} exceeds CUDA limits"

        def launch(*args, num_warps: int = 4, num_stages: int = 3, **constexprs):
            signature, constants, attrs = _signature(self.fn, args, constexprs)
            key = (self.fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constants.items())), num_warps, num_stages)
            if key not in _COMPILED:
                source = ASTSource(self.fn, signature, constants, attrs)
                options = {"num_warps": num_warps, "num_stages": num_stages}
                _COMPILED[key] = triton.compile(source, target=HOPPER, options=options)
            assert "cubin" in _COMPILED[key].asm

        return launch


@pytest.fixture
def compile_only(monkeypatch):
    for name in ("kernels.rms_norm", "kernels.swiglu", "kernels.rope", "kernels.permute", "kernels.qk_norm_rope",
                 "kernels.router", "kernels.grouped_gemm", "kernels.cross_entropy", "optim.adamw", "kernels.mla_rope",
                 "kernels.expert_bias", "kernels.clamped_swiglu", "kernels.attention_sinks", "kernels.sum_squares",
                 "kernels.fp8_quantize", "kernels.fp8_grouped_gemm"):  # fmt: skip
        module = importlib.import_module(f"moetune.{name}")
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction) and attr.endswith("_kernel"):  # launched kernels, not jit helpers
                monkeypatch.setattr(module, attr, _CompileOnly(obj))


def _fwd_bwd(outputs, inputs):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.grad(outputs, inputs, [torch.zeros_like(o) for o in outputs])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 2048), (2, 16, 32, 128), (4, 8192), (3, 100)])
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("round_before_weight", [True, False])
def test_rms_norm_compiles_for_hopper(compile_only, dtype, shape, weight_grad, round_before_weight):
    x = torch.zeros(shape, dtype=dtype, requires_grad=True)
    w = torch.ones(shape[-1], dtype=dtype, requires_grad=weight_grad)
    _fwd_bwd(rms_norm(x, w, round_before_weight=round_before_weight, impl="triton"), (x, w) if weight_grad else (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_of_squares_compiles_for_hopper(compile_only, dtype):
    from moetune.kernels.sum_squares import sum_of_squares

    sum_of_squares([torch.zeros(5000, dtype=dtype), torch.zeros(3, 7, dtype=dtype)], impl="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [768, 6144, 37])
def test_swiglu_compiles_for_hopper(compile_only, dtype, width):
    gate_up = torch.zeros(64, 2 * width, dtype=dtype, requires_grad=True)
    _fwd_bwd(swiglu(gate_up, impl="triton"), (gate_up,))
    _fwd_bwd(swiglu(gate_up, num_valid=torch.tensor([40]), impl="triton"), (gate_up,))
    gate, up = (torch.zeros(64, width, dtype=dtype, requires_grad=True) for _ in range(2))
    _fwd_bwd(swiglu_split(gate, up, impl="triton"), (gate, up))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_heads, k_heads, head_dim", [(32, 4, 128), (64, 1, 64), (4, 4, 12)])
def test_rope_compiles_for_hopper(compile_only, dtype, q_heads, k_heads, head_dim):
    q = torch.zeros(2, 64, q_heads, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.zeros(2, 64, k_heads, head_dim, dtype=dtype).transpose(1, 2).requires_grad_()
    cos = sin = torch.zeros(1, 64, head_dim, dtype=dtype)
    _fwd_bwd(apply_rope(q, k, cos, sin, impl="triton"), (q, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 4100])
def test_permute_and_combine_compile_for_hopper(compile_only, dtype, hidden):
    num_tokens, top_k = 16, 8
    order_N = torch.randperm(num_tokens * top_k)
    x_TH = torch.zeros(num_tokens, hidden, dtype=dtype, requires_grad=True)
    _fwd_bwd(moe_permute(x_TH, order_N, top_k, impl="triton"), (x_TH,))
    num_valid = torch.tensor([num_tokens * top_k - 5], dtype=torch.int32)  # padding rows masked in backward
    _fwd_bwd(moe_permute(x_TH, order_N, top_k, num_valid=num_valid, impl="triton"), (x_TH,))
    y_NH = torch.zeros(num_tokens * top_k, hidden, dtype=dtype, requires_grad=True)
    weights_TK = torch.rand(num_tokens, top_k, requires_grad=True)
    _fwd_bwd(moe_combine(y_NH, weights_TK, order_N, impl="triton"), (y_NH, weights_TK))
    _fwd_bwd(moe_combine(y_NH, weights_TK, order_N, num_valid=num_valid, impl="triton"), (y_NH, weights_TK))
    fp32_partials = moe_combine(y_NH, weights_TK, order_N, num_valid=num_valid, out_dtype=torch.float32, impl="triton")
    _fwd_bwd(fp32_partials, (y_NH, weights_TK))
    from moetune.kernels.permute import permute_rows

    permute_rows(x_TH.detach(), order_N, top_k, num_valid=num_valid, impl="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_rope_compiles_for_hopper(compile_only, dtype):
    from moetune.kernels.qk_norm_rope import qk_norm_rope

    proj_q = torch.zeros(1, 64, 32 * 128, dtype=dtype, requires_grad=True)
    proj_k = torch.zeros(1, 64, 4 * 128, dtype=dtype, requires_grad=True)
    q, k = proj_q.view(1, 64, 32, 128), proj_k.view(1, 64, 4, 128)
    weights = [torch.ones(128, dtype=dtype, requires_grad=True) for _ in range(2)]
    cos = sin = torch.zeros(1, 64, 128, dtype=dtype)
    _fwd_bwd(qk_norm_rope(q, k, *weights, cos, sin, 1e-6, impl="triton"), (proj_q, proj_k, *weights))


@pytest.mark.parametrize("normalize", [True, False])
def test_router_compiles_for_hopper(compile_only, normalize):
    from moetune.kernels.router import softmax_topk

    logits = torch.zeros(64, 128, dtype=torch.bfloat16, requires_grad=True)
    weights, _ = softmax_topk(logits, 8, normalize=normalize, impl="triton")
    _fwd_bwd(weights, (logits,))


def test_grouped_gemm_compiles_for_hopper(compile_only):
    from moetune.kernels.grouped_gemm import grouped_rows_mm, grouped_weight_grad

    offsets = torch.tensor([100, 256, 512], dtype=torch.int32)
    order = torch.randperm(512)
    x, w = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(3, 384, 256, dtype=torch.bfloat16)
    grouped_rows_mm(x, w.transpose(1, 2), offsets, gather_order=order, top_k=8, impl="triton")
    grouped_rows_mm(torch.zeros(512, 384, dtype=torch.bfloat16), w, offsets, impl="triton")
    grouped_weight_grad(torch.zeros(512, 384, dtype=torch.bfloat16), x, offsets, q_gather_order=order, top_k=8, impl="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_compiles_for_hopper(compile_only, dtype):
    """Host scalars, device lr / step (the capturable step), and the clipping coefficient."""
    from moetune.optim.adamw import _triton_step

    tensors = [torch.zeros(3 * 1024 * 1024, dtype=dtype) for _ in range(4)]
    settings = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    _triton_step(*tensors, lr=1e-5, step=3, **settings)
    _triton_step(*tensors, lr=torch.tensor(1e-5), step=torch.tensor(3.0), **settings)
    _triton_step(*tensors, lr=torch.tensor(1e-5), step=torch.tensor(3.0), grad_scale=torch.tensor(0.5), **settings)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_kernels_compile_for_hopper(compile_only, dtype):
    """The fused loss's kernel and the vocabulary-parallel loss's two (shard statistics, shard
    gradient), at Qwen3's vocabulary and half of it."""
    from moetune.kernels.cross_entropy import cross_entropy_grad_, cross_entropy_shard_grad_, cross_entropy_shard_stats

    targets = torch.zeros(16, dtype=torch.int64)
    cross_entropy_grad_(torch.zeros(16, 151_936, dtype=dtype), targets, torch.tensor(4.0), impl="triton")
    shard = torch.zeros(16, 75_968, dtype=dtype)
    cross_entropy_shard_stats(shard, targets, 75_968, impl="triton")
    cross_entropy_shard_grad_(shard, targets, torch.zeros(16), torch.ones(16), 75_968, impl="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved, pad_values", [(True, False), (False, True)])
@pytest.mark.parametrize("heads", [16, 128])  # Moonlight-16B-A3B, DeepSeek-V3 / Kimi-K2 (several head tiles)
def test_mla_kernels_compile_for_hopper(compile_only, dtype, interleaved, pad_values, heads):
    from moetune.kernels.mla_rope import mla_queries_keys_values

    seq = 64
    q = torch.zeros(1, seq, heads, 192, dtype=dtype, requires_grad=True)
    kv = torch.zeros(1, seq, heads * 256, dtype=dtype).view(1, seq, heads, 256).requires_grad_()
    k_rot = torch.zeros(1, seq, 576, dtype=dtype)[..., 512:].requires_grad_()
    cos = sin = torch.zeros(1, seq, 64, dtype=dtype)
    out = mla_queries_keys_values(q, kv, k_rot, cos, sin, interleaved=interleaved, pad_values=pad_values, impl="triton")
    _fwd_bwd(out, [q, kv, k_rot])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_bias_and_clamped_swiglu_compile_for_hopper(compile_only, dtype):
    """GPT-OSS-20B's expert shapes: the bias rows' one-pass add and the gradient's segment sums, and
    the clamped SwiGLU (with and without a count of valid rows)."""
    from moetune.kernels.clamped_swiglu import clamped_swiglu
    from moetune.kernels.expert_bias import add_expert_bias

    offsets = torch.arange(1, 33, dtype=torch.int32) * 8
    h, bias = torch.zeros(264, 5760, dtype=dtype, requires_grad=True), torch.zeros(32, 5760, dtype=dtype, requires_grad=True)
    expert = torch.searchsorted(offsets, torch.arange(264, dtype=torch.int32), right=True)  # 8 padding rows
    _fwd_bwd(add_expert_bias(h, bias, expert, offsets, impl="triton"), [h, bias])
    h = torch.zeros(256, 5760, dtype=dtype, requires_grad=True)
    for num_valid in (None, torch.tensor([200])):
        _fwd_bwd(clamped_swiglu(h, alpha=1.702, limit=7.0, num_valid=num_valid, impl="triton"), [h])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_sink_kernels_compile_for_hopper(compile_only, dtype):
    """GPT-OSS-20B's heads, in the flash kernels' layouts ([T, H, D], [H, T + padding])."""
    from moetune.kernels.attention_sinks import sink_grad, sink_scale

    out = torch.zeros(1, 64, 64, 64, dtype=dtype)
    lse = torch.zeros(64, 80)[:, :64][None]
    sinks = torch.zeros(64, dtype=dtype)
    sink_grad(out, sink_scale(out, lse, sinks, torch.zeros(1, 64, 64), impl="triton"), lse, sinks, impl="triton")


@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_kernels_compile_for_hopper(compile_only, blockwise):
    """The FP8 quantisers and GEMMs at Qwen3-30B-A3B's expert shapes (hidden 2048, width 768, 128
    experts), launched as ``moetune.fp8`` launches them; the GEMMs must use Hopper's FP8 wgmma."""
    from moetune.kernels import fp8_grouped_gemm
    from moetune.kernels.fp8_quantize import column_layout, quantize_blocks, quantize_columns, quantize_rows

    block = 128 if blockwise else None
    tokens, hidden, width, experts = 512, 2048, 768, 128
    offsets = torch.arange(1, experts + 1, dtype=torch.int32) * (tokens // experts)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    w = torch.zeros(experts, 2 * width, hidden, dtype=torch.bfloat16)
    x_q, x_scale = quantize_rows(x, block=block, impl="triton")
    w_q, w_scale = quantize_blocks(w, impl="triton") if blockwise else quantize_rows(w, impl="triton")
    quantize_blocks(w.transpose(-2, -1), impl="triton") if blockwise else quantize_rows(w.transpose(-2, -1), impl="triton")
    fp8_grouped_gemm.fp8_rows_mm(x_q, x_scale, w_q, w_scale, offsets, blockwise=blockwise, impl="triton")
    p_q, p_scale, padded = quantize_columns(torch.zeros(tokens, 2 * width, dtype=torch.bfloat16), offsets, block=block, impl="triton")
    q_q, q_scale, _ = quantize_columns(x, offsets, block=block, impl="triton")
    fp8_grouped_gemm.fp8_weight_grad(p_q, p_scale, q_q, q_scale, padded, column_layout(offsets)[1], blockwise=blockwise,
                                     impl="triton")  # fmt: skip
    gemms = [c for key, c in _COMPILED.items() if key[0] in ("_fp8_rows_kernel", "_fp8_weight_grad_kernel")]
    assert gemms and all("wgmma.mma_async" in c.asm["ptx"] and "e4m3" in c.asm["ptx"] for c in gemms)
