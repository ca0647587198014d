"""Grouped experts: every expert's weights in one 3-D tensor, applied to tokens sorted by expert.

The module knows nothing about communication: expert parallelism hands it the tokens of its
local experts (already permuted) and the count per local expert.

Shape legend: N routed rows (token-expert pairs) sorted by expert, T source rows (tokens), K routed
copies per token, H hidden, I expert width, X first projection's width (2I gated, I plain), E experts
held by this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from moetune.fp8.functions import fp8_grouped_linear
from moetune.kernels import moe_permute, quack_grouped_gemm, swiglu
from moetune.kernels._triton_utils import Impl
from moetune.kernels.clamped_swiglu import clamped_swiglu
from moetune.kernels.expert_bias import add_expert_bias
from moetune.kernels.grouped_gemm import grouped_mm as _grouped_mm
from moetune.kernels.grouped_gemm import grouped_mm_supported, grouped_rows_mm, grouped_weight_grad
from moetune.kernels.permute import permute_rows, permute_rows_backward
from moetune.utils.autocast import cuda_autocast_dtype

if TYPE_CHECKING:
    from moetune.fp8.settings import Fp8Settings


EXPERTS_BACKENDS = ("auto", "grouped_mm", "triton", "quack", "loop")
"""``auto``: torch's grouped GEMM on CUDA bf16 (fp32 weights under CUDA bf16 autocast included), the
per-expert loop elsewhere; ``triton``: moetune's
Triton row GEMMs (the dispatch gather fused into the first one) with torch's weight-gradient GEMM;
``quack``: quack's CuTe-DSL grouped GEMMs for all three (the gather fused into the first one; optional
package, CUDA sm90+: ``moetune.kernels.quack_grouped_gemm``)."""


class ExpertAdapter(NamedTuple):
    """A LoRA adapter per expert on one of the experts' weights W [E, O, I] (``moetune.lora``):
    the experts compute ``rows @ W_e^T + scaling * (rows @ A_e^T) @ B_e^T``, the low-rank path on the
    activations, so W_e + scaling * B_e @ A_e is never formed and a frozen W gets no weight gradient."""

    a_ERI: torch.Tensor
    b_EOR: torch.Tensor
    scaling: float


def _relu_squared(t: torch.Tensor) -> torch.Tensor:
    return F.relu(t).square()


def _activation(name: str):
    # Module-level functions, not lambdas: a model holding them pickles (torch.save(model), deepcopy).
    if name == "silu":
        return F.silu
    if name == "relu2":
        return _relu_squared
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported expert activation {name!r} (supported: silu, relu2, gelu)")


class GroupedExperts(nn.Module):
    """E experts; gated (SwiGLU-style, ``gate_up_proj`` [E, 2I, H]) or plain (``up_proj`` [E, I, H]).

    Parameter names and layouts are Transformers v5's fused layout, so state dicts, PEFT targets
    and user code that reads ``mlp.experts.gate_up_proj`` keep working. ``transposed`` stores the
    weights [E, in, out] and ``bias`` adds ``<weight>_bias`` [E, out] (GPT-OSS's layout, with
    ``activation="clamped_swiglu"``: gate and up interleaved, clamped at ``swiglu_limit``,
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        gated: bool = True,
        backend: str = "auto",
        transposed: bool = False,
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if backend not in EXPERTS_BACKENDS:
            raise ValueError(f"experts backend must be one of {EXPERTS_BACKENDS}, got {backend!r}")
        if activation == "clamped_swiglu" and not gated:
            raise ValueError("activation 'clamped_swiglu' needs gated experts")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gated = gated
        self.backend = backend
        self.is_transposed = transposed  # Transformers' and PEFT's name for the [E, in, out] layout
        self.has_bias = bias
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self._act = None if activation == "clamped_swiglu" else _activation(activation)
        self.fp8: Fp8Settings | None = None
        """FP8 training of both grouped GEMMs (``moetune.fp8.enable_fp8``); None: the weights' dtype."""
        in_width = 2 * intermediate_size if gated else intermediate_size
        self._in_name = "gate_up_proj" if gated else "up_proj"
        for name, out_dim, in_dim in ((self._in_name, in_width, hidden_size), ("down_proj", hidden_size, intermediate_size)):
            shape = (num_experts, in_dim, out_dim) if transposed else (num_experts, out_dim, in_dim)
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
            if bias:
                self.register_parameter(f"{name}_bias", nn.Parameter(torch.empty(num_experts, out_dim)))

    @property
    def in_proj(self) -> torch.Tensor:
        return getattr(self, self._in_name)

    @property
    def weight_names(self) -> tuple[str, str]:
        """The first and the second projection's parameter names."""
        return self._in_name, "down_proj"

    def lora_adapters(self) -> tuple[ExpertAdapter | None, ExpertAdapter | None]:
        """The LoRA adapters on the two projections, applied to the activations by the experts'
        GEMMs. None here; ``moetune.lora`` gives an adapted module's class its own."""
        return None, None

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        *,
        gather_order: torch.Tensor | None = None,
        gather_top_k: int = 1,
    ) -> torch.Tensor:
        """Output rows [N, H] for input rows sorted by expert (``x`` is [N, H]), or, with
        ``gather_order``, for the rows ``x[gather_order // gather_top_k]`` (``x`` is [T, H], N = T * K):
        see ``run_experts``."""
        if torch.compiler.is_compiling() and isinstance(self.in_proj, DTensor):
            # Under torch.compile, dynamo does not trace the unwrap of expert-parallel (DTensor) weights
            # (it keeps a DTensor and fails on mixed DTensor / tensor GEMMs, torch 2.13): the experts
            # run eagerly there (a graph break) and the rest of the layer stays compiled.
            return _experts_eagerly(self, x, tokens_per_expert_E, gather_order=gather_order, gather_top_k=gather_top_k)
        return self._run(x, tokens_per_expert_E, gather_order=gather_order, gather_top_k=gather_top_k)

    def _run(self, x, tokens_per_expert_E, *, gather_order, gather_top_k) -> torch.Tensor:
        weights, adapters = [], []
        for name, adapter in zip(self.weight_names, self.lora_adapters()):
            peft = None if adapter is not None else self._peft_factors(name)
            weight = getattr(self, name) if peft is None else peft[0]
            weights.append(_local(weight).transpose(-2, -1) if self.is_transposed else _local(weight))
            adapter = adapter if peft is None else peft[1]
            adapters.append(None if adapter is None else ExpertAdapter(_local(adapter.a_ERI), _local(adapter.b_EOR), adapter.scaling))
        (in_proj, down_proj), (in_adapter, down_adapter) = weights, adapters  # [E, out, in] views
        biases = {}
        if self.has_bias:
            biases = {"in_bias": _local(getattr(self, f"{self._in_name}_bias")), "down_bias": _local(self.down_proj_bias)}
        return run_experts(
            x, tokens_per_expert_E, in_proj, down_proj, activate=self._activate, backend=self.backend,
            gather_order=gather_order, gather_top_k=gather_top_k, in_adapter=in_adapter, down_adapter=down_adapter,
            fp8=self.fp8, **biases,
        )  # fmt: skip

    def _peft_factors(self, name: str) -> tuple[torch.Tensor, ExpertAdapter] | None:
        """PEFT's LoRA on this weight (``LoraConfig(target_parameters=[...])``: its ``ParamWrapper``
        parametrizes the weight as ``W + scaling * lhs @ rhs`` while this module's forward runs), as
        the plain weight and an adapter the experts apply to the activations: the same function,
        without forming the adapted [E, out, in] weight or its gradient. None for any other
        parametrization (it is then read as the parametrized weight)."""
        if not parametrize.is_parametrized(self, name):
            return None
        chain = self.parametrizations[name]
        if len(chain) != 1 or type(chain[0]).__name__ != "_LoraFactorsProxy":
            return None
        factors = chain[0]
        lhs, rhs = factors.lhs, factors.rhs  # the stored layout's delta is lhs @ rhs
        if self.is_transposed:  # [E, in, out]: the [E, out, in] delta is rhs^T @ lhs^T
            return chain.original, ExpertAdapter(lhs.transpose(-2, -1), rhs.transpose(-2, -1), float(factors.scaling))
        return chain.original, ExpertAdapter(rhs, lhs, float(factors.scaling))

    def _activate(self, h_NX: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(h_NX, alpha=self.swiglu_alpha, limit=self.swiglu_limit, num_valid=num_valid)
        if not self.gated:
            return self._act(h_NX)
        return gated_activation(h_NX, self._act, swiglu_kernel=self.activation == "silu", num_valid=num_valid)

    def extra_repr(self) -> str:
        layout = ", transposed" if self.is_transposed else ""
        layout += ", bias" if self.has_bias else ""
        layout += f", fp8={self.fp8.recipe}" if self.fp8 is not None else ""
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.intermediate_size}, "
            f"activation={self.activation}, gated={self.gated}{layout}, backend={self.backend}"
        )


def gated_activation(
    h_NX: torch.Tensor, act, *, swiglu_kernel: bool, num_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """act(gate) * up for h = [gate | up]; SiLU goes through the fused SwiGLU kernel, which skips the
    padding rows from ``num_valid`` on."""
    if swiglu_kernel:
        return swiglu(h_NX, num_valid=num_valid)
    gate, up = h_NX.chunk(2, dim=-1)
    return act(gate) * up


def run_experts(
    x: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    in_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activate,
    backend: str = "auto",
    in_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gather_order: torch.Tensor | None = None,
    gather_top_k: int = 1,
    in_adapter: ExpertAdapter | None = None,
    down_adapter: ExpertAdapter | None = None,
    fp8: Fp8Settings | None = None,
) -> torch.Tensor:
    """down_e(activate(in_e(rows))) for rows sorted by expert e; weights [E, out, in] (nn.Linear layout),
    optional biases [E, out], optional LoRA adapters on either weight (``ExpertAdapter``, computed in
    the weights' dtype). ``fp8``: both GEMMs in FP8 (``moetune.fp8``; the adapters, biases and the
    activation stay in the weights' dtype), on any device, whatever ``backend`` says.

    The rows are ``x`` [N, H] itself, or with ``gather_order`` (N = T * K entries, a permutation of the
    routed slots) ``x[gather_order // gather_top_k]`` for ``x`` [T, H]: the experts gather their input
    themselves and keep only ``x`` for the backward (see ``GatheredGroupedMM``).

    Rows past ``tokens_per_expert_E.sum()`` are padding (capacity-padded or all-gathered expert
    parallelism): the grouped GEMM skips them (their output rows are undefined), the loop gives them
    zeros, and neither lets them reach the gradients of ``x`` or of the biases. The grouped path calls
    ``activate(h_NX, num_valid)`` (a one-element device count; the activation may skip the rows from
    there on, as the SwiGLU kernel does), the loop ``activate(h_NX)``.
    """
    if gather_order is not None:
        _check_gather(x, gather_order, gather_top_k)
    compute_dtype = cuda_autocast_dtype(x)
    if compute_dtype is not None and (x.dtype, in_proj.dtype) != (compute_dtype, compute_dtype):
        # What autocast would do to each expert's nn.Linear, done once for the grouped GEMM (which
        # autocast does not cast): fp32 weights under bf16 autocast take the grouped path too, so
        # the experts neither loop over experts nor read the split sizes on the host.
        x, in_proj, down_proj = x.to(compute_dtype), in_proj.to(compute_dtype), down_proj.to(compute_dtype)
        in_bias, down_bias = (None if b is None else b.to(compute_dtype) for b in (in_bias, down_bias))
    # fp32 adapters (PEFT's default) under bf16 weights run in bf16: casting the small adapters, not the rows.
    in_adapter, down_adapter = (None if a is None else _cast_adapter(a, in_proj.dtype) for a in (in_adapter, down_adapter))
    if fp8 is not None or backend in ("grouped_mm", "triton", "quack") or (backend == "auto" and grouped_mm_supported(x)):
        # No host sync: the group boundaries stay on the device.
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        x, w_EHX = x.to(in_proj.dtype), in_proj.transpose(-2, -1)
        if fp8 is not None:
            h_NX = fp8_grouped_linear(x, in_proj, offsets_E, settings=fp8, gather_order=gather_order, top_k=gather_top_k)
        elif backend in ("triton", "quack") or gather_order is not None:
            rows_backend = backend if backend in ("triton", "quack") else "grouped_mm"
            h_NX = GatheredGroupedMM.apply(x, w_EHX, gather_order, offsets_E, gather_top_k, "auto", rows_backend)
        else:
            h_NX = _grouped_mm(x, w_EHX, offs=offsets_E)
        if in_adapter is not None:
            h_NX = h_NX + _grouped_low_rank(x, in_adapter, offsets_E, gather_order, gather_top_k)
        expert_N = None
        if in_bias is not None or down_bias is not None:
            rows = torch.arange(h_NX.shape[0], device=x.device, dtype=torch.int32)
            expert_N = torch.searchsorted(offsets_E, rows, right=True)  # E for padding rows
        h_NX = h_NX if in_bias is None else add_expert_bias(h_NX, in_bias, expert_N, offsets_E)
        a_NI = activate(h_NX, offsets_E[-1:]).to(h_NX.dtype)  # autocast runs some (relu2's pow) in fp32
        if fp8 is not None:
            y_NH = fp8_grouped_linear(a_NI, down_proj, offsets_E, settings=fp8)
        elif backend in ("triton", "quack"):
            y_NH = GatheredGroupedMM.apply(a_NI, down_proj.transpose(-2, -1), None, offsets_E, 1, "auto", backend)
        else:
            y_NH = _grouped_mm(a_NI, down_proj.transpose(-2, -1), offs=offsets_E)
        if down_adapter is not None:
            y_NH = y_NH + _grouped_low_rank(a_NI, down_adapter, offsets_E, None, 1)
        return y_NH if down_bias is None else add_expert_bias(y_NH, down_bias, expert_N, offsets_E)
    if gather_order is not None:
        num_valid = tokens_per_expert_E.sum().reshape(1)
        x = moe_permute(x, gather_order, gather_top_k, num_valid=num_valid)
    if torch.compiler.is_compiling():
        # torch.compile (Transformers' compiled generation: fullgraph, static shapes) cannot trace the
        # loop below, which sizes its splits from the counts read on the host.
        return _experts_with_gathered_weights(
            x, tokens_per_expert_E, in_proj, down_proj, activate=activate, in_bias=in_bias, down_bias=down_bias,
            in_adapter=in_adapter, down_adapter=down_adapter,
        )  # fmt: skip
    # One host sync for the split sizes; used on CPU and as the reference path.
    counts = tokens_per_expert_E.tolist()

    def linear(rows, weight, bias, adapter, expert):
        out = F.linear(rows, weight[expert], None if bias is None else bias[expert])
        if adapter is not None:
            out = out + adapter.scaling * F.linear(F.linear(rows, adapter.a_ERI[expert]), adapter.b_EOR[expert])
        return out

    outputs = [
        linear(activate(linear(rows_NH, in_proj, in_bias, in_adapter, expert)), down_proj, down_bias, down_adapter, expert)
        for expert, rows_NH in enumerate(torch.split(x[: sum(counts)], counts))
        if rows_NH.shape[0] > 0
    ]
    padding_NH = x[sum(counts) :]
    if padding_NH.shape[0] or not outputs:
        # Padding rows give zeros. With no real rows the weights and the (empty) input still join the
        # graph, so every rank's backward has the same shape: FSDP2's post-backward hook on the input
        # fires and the all-to-all that delivered the rows runs its backward, as on the other ranks.
        # In the dtype the real rows come out in (autocast's), on every rank alike: the all-to-all that
        # takes them back must move the same bytes per row from a rank with no rows as from the others.
        dtype = _linear_output_dtype(x, down_proj)
        zeros = padding_NH.new_zeros(padding_NH.shape[0], down_proj.shape[1], dtype=dtype)
        adapters = [t for a in (in_adapter, down_adapter) if a is not None for t in (a.a_ERI, a.b_EOR)]
        weights = [t for t in (in_proj, down_proj, in_bias, down_bias, *adapters) if t is not None]
        outputs.append(zeros + (0 * (sum(t.sum() for t in weights) + padding_NH.sum())).to(dtype))
    return torch.cat(outputs)


def _linear_output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What ``F.linear(x, weight)`` returns: autocast's dtype where autocast is on for ``x``'s device."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(x.dtype, weight.dtype)


def _experts_with_gathered_weights(
    x_NH: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    in_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activate,
    in_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    in_adapter: ExpertAdapter | None,
    down_adapter: ExpertAdapter | None,
) -> torch.Tensor:
    """``run_experts``' loop with no shape that depends on the counts: each row is multiplied by its own
    expert's weights, gathered per row (Transformers' ``batched_mm`` experts do the same), padding rows
    (past ``tokens_per_expert_E.sum()``) give zeros. The compiled path where no grouped GEMM runs: it
    reads the weights once per row, right for decoding's few rows, not for long compiled prefills on CPU."""
    num_experts = in_proj.shape[0]
    rows_N = torch.arange(x_NH.shape[0], device=x_NH.device)
    expert_N = torch.searchsorted(torch.cumsum(tokens_per_expert_E, dim=0), rows_N, right=True)
    valid_N1 = (expert_N < num_experts).unsqueeze(-1)
    expert_N = expert_N.clamp(max=num_experts - 1)

    def linear(rows, weight_EOI, bias_EO, adapter):
        out = torch.bmm(weight_EOI[expert_N], rows.unsqueeze(-1)).squeeze(-1)
        if bias_EO is not None:
            out = out + bias_EO[expert_N]
        if adapter is not None:
            low_rank = torch.bmm(adapter.a_ERI[expert_N], rows.unsqueeze(-1))
            out = out + adapter.scaling * torch.bmm(adapter.b_EOR[expert_N], low_rank).squeeze(-1)
        return out

    h_NX = linear(x_NH.to(in_proj.dtype), in_proj, in_bias, in_adapter)
    y_NH = linear(activate(h_NX).to(h_NX.dtype), down_proj, down_bias, down_adapter)
    return torch.where(valid_N1, y_NH, torch.zeros_like(y_NH))


def _cast_adapter(adapter: ExpertAdapter, dtype: torch.dtype) -> ExpertAdapter:
    return ExpertAdapter(adapter.a_ERI.to(dtype), adapter.b_EOR.to(dtype), adapter.scaling)


def _grouped_low_rank(x, adapter: ExpertAdapter, offsets_E, gather_order, gather_top_k: int) -> torch.Tensor:
    """scaling * (rows @ A_e^T) @ B_e^T per expert group, rows as in ``run_experts`` (gathered from
    ``x`` with ``gather_order``); [N, O], padding rows undefined as in the grouped GEMMs.

    Two thin grouped GEMMs (rank R columns), each ~R/O of the base GEMM's FLOPs. torch's grouped GEMM
    needs 16-byte aligned rows, so the rank is zero-padded to a multiple of 8 (exact)."""
    # PEFT's factors may come as views whose experts' dimension is the innermost (E-stride 1), a layout
    # torch's grouped GEMM refuses; they are small (R columns), so a contiguous copy costs little.
    a_ERI, b_EOR = adapter.a_ERI.contiguous(), (adapter.b_EOR * adapter.scaling).contiguous()
    if not grouped_mm_supported(x):  # the FP8 experts off CUDA bf16 (their reference): a loop over experts
        rows = x if gather_order is None else moe_permute(x, gather_order, gather_top_k, num_valid=offsets_E[-1:])
        return _low_rank_loop(rows, a_ERI, b_EOR, offsets_E)
    rank = a_ERI.shape[1]
    if rank % 8:
        pad = 8 - rank % 8
        a_ERI, b_EOR = F.pad(a_ERI, (0, 0, 0, pad)), F.pad(b_EOR, (0, pad))
    # GatheredGroupedMM gathers the rows itself and keeps only x for the backward (where it gathers
    # them again for dA): one more memory-bound gather, no second [N, H] copy of the rows kept alive.
    u_NR = GatheredGroupedMM.apply(x, a_ERI.transpose(-2, -1), gather_order, offsets_E, gather_top_k)
    return _grouped_mm(u_NR, b_EOR.transpose(-2, -1), offs=offsets_E)


def _low_rank_loop(rows_N: torch.Tensor, a_ERI: torch.Tensor, b_EOR: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """(rows @ A_e^T) @ B_e^T per expert group, one host sync for the boundaries; padding rows zero."""
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
    num_valid = sum(counts)
    parts = [F.linear(F.linear(rows, a_ERI[e]), b_EOR[e]) for e, rows in enumerate(torch.split(rows_N[:num_valid], counts))]
    padding = rows_N.new_zeros(rows_N.shape[0] - num_valid, b_EOR.shape[1])
    return torch.cat([*parts, padding])


def _check_gather(x_TH: torch.Tensor, gather_order: torch.Tensor, top_k: int) -> None:
    if x_TH.dim() != 2 or gather_order.dim() != 1 or gather_order.numel() != x_TH.shape[0] * top_k:
        raise ValueError(
            f"gather_order must list the {top_k} routed slots of each of x's rows, got x {tuple(x_TH.shape)} "
            f"and gather_order {tuple(gather_order.shape)} with gather_top_k={top_k}"
        )
    if gather_order.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"gather_order must be int32 or int64, got {gather_order.dtype}")


class GatheredGroupedMM(torch.autograd.Function):
    """``rows @ w_EHX[e]`` per expert group, rows ``x_TH[order_N // K]`` (or ``x`` itself when
    ``order_N`` is None), keeping ``x_TH`` for the backward instead of the gathered rows.

    Why: the experts' first GEMM is the only consumer of the permuted tokens, and autograd's
    ``_grouped_mm`` saves its input for the weight gradient: a second copy of the tokens, K times the
    size of ``x_TH`` (32768 x 2048 bf16 rows are 134 MB per layer). This Function saves only ``x_TH``
    (often kept anyway: the router's and the shared experts' linears save it), ``order_N``, the weight
    and the offsets, and the backward gathers the rows again (one bandwidth-bound copy) for the
    weight-gradient GEMM. The data gradient goes back to ``x_TH`` through the permutation's
    deterministic gather-sum, which skips sorted rows ``>= offsets_E[-1]``: those are padding, where
    the GEMM writes nothing (their gradient rows are uninitialised memory). No host sync: CUDA-graph
    capturable. ``impl`` picks the gather kernels as ``moe_permute``'s does (Triton on CUDA; tests
    force it on CPU under the interpreter).

    ``backend``: the row GEMMs (forward and data gradient) with torch's grouped GEMM after
    moetune's gather (``"grouped_mm"``), or with moetune's Triton kernel, which gathers inside its
    loads (``"triton"``), or with quack's kernels, which gather inside theirs too (``"quack"``).
    The weight gradient is quack's under ``"quack"``, torch's grouped GEMM otherwise: torch's runs the
    short-reduction shape (~256 rows per expert) faster than the Triton kernel
    (``benchmarks/results/grouped_gemm_probe_h200_032b0de.jsonl``).
    """

    @staticmethod
    def forward(ctx, x_TH, w_EHX, order_N, offsets_E, top_k: int, impl: Impl = "auto", backend: str = "grouped_mm"):
        ctx.save_for_backward(x_TH, w_EHX, order_N, offsets_E)
        ctx.top_k, ctx.impl, ctx.backend = top_k, impl, backend
        return _rows_mm(x_TH, w_EHX, offsets_E, order_N, top_k, backend=backend, impl=impl)

    @staticmethod
    def backward(ctx, dh_NX):
        x_TH, w_EHX, order_N, offsets_E = ctx.saved_tensors
        dh_NX = dh_NX.contiguous()
        num_valid = offsets_E[-1:]
        dx_TH = dw_EHX = None
        if ctx.needs_input_grad[0]:
            dx_TH = _rows_mm(dh_NX, w_EHX.transpose(-2, -1), offsets_E, None, 1, backend=ctx.backend, impl=ctx.impl)
            if order_N is not None:
                dx_TH = permute_rows_backward(dx_TH, order_N, ctx.top_k, num_valid=num_valid, impl=ctx.impl)
        if ctx.needs_input_grad[1]:
            x_NH = x_TH if order_N is None else permute_rows(x_TH, order_N, ctx.top_k, num_valid=num_valid, impl=ctx.impl)
            # torch's own _grouped_mm_mat2_backward: a column-major weight gets a column-major gradient.
            column_major = w_EHX.stride(-2) == 1 and w_EHX.stride(-1) == w_EHX.shape[-2]
            p_N, q_N = (dh_NX, x_NH) if column_major else (x_NH, dh_NX)
            if ctx.backend == "quack":
                dw = quack_grouped_gemm.weight_grad(p_N, q_N, offsets_E)
            elif ctx.backend == "grouped_mm" or grouped_mm_supported(x_NH):
                dw = _grouped_mm(p_N.t(), q_N, offs=offsets_E)
            else:  # the Triton backend off CUDA: the reference loop
                dw = grouped_weight_grad(p_N, q_N, offsets_E, impl="torch")
            dw_EHX = dw.transpose(-2, -1) if column_major else dw
        return dx_TH, dw_EHX, None, None, None, None, None


def _rows_mm(a, b_EKC, offsets_E, order_N, top_k: int, *, backend: str, impl: Impl) -> torch.Tensor:
    """Rows ``a`` (or ``a[order_N // top_k]``) times ``b_EKC[e]`` per group; padding rows left unwritten."""
    if backend == "triton":
        return grouped_rows_mm(a, b_EKC, offsets_E, gather_order=order_N, top_k=top_k, impl=impl)
    if backend == "quack":
        return quack_grouped_gemm.rows_mm(a, b_EKC, offsets_E, gather_order=order_N, top_k=top_k)
    rows = a if order_N is None else permute_rows(a, order_N, top_k, num_valid=offsets_E[-1:], impl=impl)
    return _grouped_mm(rows, b_EKC, offs=offsets_E)


@torch.compiler.disable
def _experts_eagerly(experts: GroupedExperts, *args, **kwargs) -> torch.Tensor:
    return experts._run(*args, **kwargs)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel DTensor parameter (a plain tensor passes through)."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param
