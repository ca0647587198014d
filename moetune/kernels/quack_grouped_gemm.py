"""The experts' grouped GEMMs through quack (Tri Dao's lab's CuTe-DSL kernels; optional:
``pip install quack-kernels``, CUDA compute capability 9.0+).

Same contract as ``moetune.kernels.grouped_gemm``'s Triton kernels and torch's ``_grouped_mm``, on
the device-side group ends ``offsets_E`` (no host sync):

- ``rows_mm(a, b_EKC, offsets_E, gather_order=, top_k=)``: rows ``offsets[e-1]:offsets[e]`` of the
  result are ``a_rows @ b[e]`` (quack's ``varlen_m``), ``a_rows`` being ``a``'s rows or, with
  ``gather_order``, ``a[gather_order // top_k]`` read inside the GEMM's loads (quack's gather_A): the
  dispatch gather without the [N, H] permuted copy. Rows ``>= offsets[-1]`` are padding, unwritten.
- ``weight_grad(p, q, offsets_E)``: ``out[e] = p[rows_e]^T @ q[rows_e]`` (quack's ``varlen_k``).

Why: on an H200 at Qwen3-30B-A3B's expert shapes (128 experts, H 2048, I 768, 32768 routed rows)
these run 1.03-1.25x faster than torch's CUTLASS grouped GEMM on the row GEMMs and 1.08-1.6x on
the weight gradients (``benchmarks/kernel_library_probe.py``, results in
``benchmarks/results/session20/``). quack tunes each shape on its first call (eager warm-up steps
do that before a CUDA graph is captured).

Shapes: quack's autotuner keys on every operand's exact shape, so each new number of routed rows
is a new tuning sweep (6-11 s per GEMM on an H100 at the shapes above, against ~0.5 ms a
tuned call: ``benchmarks/quack_tune_probe.py``). Steps of one fixed shape (packed
rows on one GPU; ``ep_dispatch="allgather"`` or an ``ep_capacity_factor`` under expert parallelism)
tune once. The all-to-all dispatchers' received row counts change every step: for these experts they
pad them to a few bucket sizes (``moetune.distributed.dispatcher.bucketed_row_count``, at most 1/8
padding rows, which the GEMMs skip), so each bucket tunes once. Unpacked batches of varying length
re-tune for every length (the recipe's ``data.pad_to_multiple_of`` bounds them): ``watch_row_counts``
warns once when a GEMM has seen many.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

RETUNE_WARNING_AFTER = 16
"""Distinct row counts one GEMM shape may see before the warning (each was a tuning sweep): two
doublings of the expert-parallel dispatchers' bucketed counts (8 sizes per doubling)."""


@functools.cache
def require():
    """quack's ``gemm``; raises a RuntimeError naming the package where it does not import."""
    try:
        from quack.gemm_interface import gemm
    except Exception as err:  # ImportError, or cutlass-dsl failing to find its CUDA toolkit flavour
        raise RuntimeError(
            "experts_backend='quack' needs the quack-kernels package (pip install quack-kernels, which "
            f"brings nvidia-cutlass-dsl); importing it failed: {err}"
        ) from err
    return gemm


def available() -> bool:
    """Whether quack imports here (it also needs a CUDA GPU of compute capability 9.0+ to run)."""
    try:
        require()
    except RuntimeError:
        return False
    return True


def check_supported(x: torch.Tensor) -> None:
    """Raise a clear error where quack's kernels cannot run ``x``'s experts."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        raise RuntimeError(f"experts_backend='quack' runs on CUDA GPUs of compute capability 9.0+, got a tensor on {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"experts_backend='quack' runs bf16 / fp16 experts, got {x.dtype}")


def _group_starts(offsets_E: torch.Tensor) -> torch.Tensor:
    """quack's cu_seqlens: the E group ends with a leading 0, int32, on the device."""
    return F.pad(offsets_E.to(torch.int32), (1, 0))


class RowCountWatch:
    """Counts the distinct row counts each GEMM shape is called with; warns once past ``limit``."""

    def __init__(self, limit: int = RETUNE_WARNING_AFTER) -> None:
        self.limit = limit
        self.rows_seen: dict[tuple, set[tuple[int, ...]]] = {}
        self.warned = False

    def __call__(self, gemm: str, weight_shape: tuple[int, ...], rows: tuple[int, ...]) -> None:
        if self.warned:
            return
        seen = self.rows_seen.setdefault((gemm, weight_shape), set())
        seen.add(rows)
        if len(seen) > self.limit:
            self.warned = True
            warnings.warn(
                f"experts_backend='quack': the {gemm} GEMM with weights {list(weight_shape)} has run {len(seen)} "
                "different row counts, and quack tunes every new one (seconds each). Give the experts steps "
                "of few shapes (batches packed to one length, or padded to a multiple: the recipe's "
                "data.pad_to_multiple_of; under expert parallelism with very uneven routing, "
                "ep_dispatch='allgather') or use experts_backend='grouped_mm'",
                stacklevel=3,
            )


watch_row_counts = RowCountWatch()


def rows_mm(
    a: torch.Tensor, b_EKC: torch.Tensor, offsets_E: torch.Tensor, *,
    gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> torch.Tensor:  # fmt: skip
    check_supported(a)
    rows = (a.shape[0],) if gather_order is None else (a.shape[0], gather_order.numel())
    watch_row_counts("row", tuple(b_EKC.shape), rows)
    gemm, cu = require(), _group_starts(offsets_E)
    if gather_order is None:
        return gemm(a, b_EKC, cu_seqlens_m=cu)
    return gemm(a, b_EKC, cu_seqlens_m=cu, A_idx=(gather_order // top_k).to(torch.int32))


def weight_grad(p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """[E, P, Q]: each group's ``p_rows^T @ q_rows``; an expert with no rows gets zeros."""
    check_supported(p)
    watch_row_counts("weight-gradient", (offsets_E.numel(), p.shape[1], q.shape[1]), (p.shape[0],))
    return require()(p.t(), q, cu_seqlens_k=_group_starts(offsets_E))
