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
the weight gradients (``benchmarks/probes/kernel_library_probe.py``, results in
``benchmarks/results/kernel_library_probe_h200_2fa7f57.jsonl``, 2026-12-04). quack tunes each shape on its first call (eager warm-up steps
do that before a CUDA graph is captured).

Shapes: quack's own autotuner keys on every operand's exact shape, so each new number of routed rows
would be a new tuning sweep (6-11 s per GEMM on an H100 at the shapes above, against ~0.5 ms a
tuned call: ``benchmarks/probes/quack_tune_probe.py``), and unpacked batches or the all-to-all dispatchers'
received rows bring a new count nearly every step. So moetune tunes once per GEMM shape and
power-of-two bucket of the row count (``TunedConfigs``, ``row_bucket``) and launches every other
count of that bucket with the winning config, which costs no compile (0.4-0.8 ms first call) and
runs within ~10% of the count's own tuning. Packed rows tune once, as before; a recipe on unpacked
samples tunes a handful of times.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def require():
    """quack's ``gemm_interface`` module; raises a RuntimeError naming the package where it does not import."""
    try:
        from quack import gemm_interface
    except Exception as err:  # ImportError, or cutlass-dsl failing to find its CUDA toolkit flavour
        raise RuntimeError(
            "experts_backend='quack' needs the quack-kernels package (pip install quack-kernels, which "
            f"brings nvidia-cutlass-dsl); importing it failed: {err}"
        ) from err
    return gemm_interface


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


SMALLEST_ROW_BUCKET = 8192
"""Row counts up to this share one tuned config: at Qwen3-30B-A3B's expert shapes quack's tuner picks
the same configs from 2,048 to 8,192 rows, and the 8,192-row configs run 2,048-6,000 rows within
-6%..+10% of each count's own tuning (``benchmarks/probes/quack_tune_probe.py``, H100)."""


def row_bucket(rows: int) -> int:
    """The row counts that share one tuned config: the power of two at or above ``rows``, at least
    ``SMALLEST_ROW_BUCKET``. Within a doubling a reused config stays within ~10% of the count's own
    tuning; four times the rows it loses up to 28% (the same probe)."""
    return max(1 << max(rows - 1, 0).bit_length(), SMALLEST_ROW_BUCKET)


def _layout(t: torch.Tensor) -> tuple:
    """What of a tensor's strides a kernel config depends on (quack's autotune key: 0, 1 or more)."""
    return tuple(min(s, 2) for s in t.stride())


class TunedConfigs:
    """quack's tuned ``GemmConfig`` per GEMM shape and row bucket.

    The first call of a bucket runs quack's autotuner (``gemm_tuned``), which benchmarks its
    candidate configs and returns the winner; later calls of the bucket, whatever their exact row
    count, launch that config directly (``gemm_tuned.fn(..., config=)``, the tuner's own launch),
    skipping the sweep quack's shape-exact key would start again."""

    def __init__(self) -> None:
        self.configs: dict[tuple, object] = {}
        self.tunings = 0

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, shape: tuple, rows: int, **varlen) -> torch.Tensor:
        """``out = a @ b`` as quack's ``gemm(a, b, out=out, **varlen)``. ``shape`` names the GEMM
        without its varying extent, ``rows``."""
        iface = require()
        varlen = {name: value for name, value in varlen.items() if value is not None}
        if torch.compiler.is_compiling():  # quack's custom op, which torch.compile traces through
            return iface.gemm(a, b, out=out, **varlen)
        key = (shape, _layout(a), _layout(b), a.dtype, out.dtype, tuple(sorted(varlen)), row_bucket(rows))
        config = self.configs.get(key)
        if config is None:
            self.configs[key] = iface.gemm_tuned(a, b, out, **varlen)[0]
            self.tunings += 1
        else:
            iface.gemm_tuned.fn(a, b, out, config=config, **varlen)
        return out


tuned_configs = TunedConfigs()


def rows_mm(
    a: torch.Tensor, b_EKC: torch.Tensor, offsets_E: torch.Tensor, *,
    gather_order: torch.Tensor | None = None, top_k: int = 1,
) -> torch.Tensor:  # fmt: skip
    check_supported(a)
    rows = a.shape[0] if gather_order is None else gather_order.numel()
    out = torch.empty(rows, b_EKC.shape[-1], dtype=a.dtype, device=a.device)
    if rows == 0:
        return out
    a_idx = None if gather_order is None else (gather_order // top_k).to(torch.int32)
    return tuned_configs.run(a, b_EKC, out, shape=("rows", *b_EKC.shape), rows=rows, cu_seqlens_m=_group_starts(offsets_E), A_idx=a_idx)


def weight_grad(p: torch.Tensor, q: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """[E, P, Q]: each group's ``p_rows^T @ q_rows``; an expert with no rows gets zeros."""
    check_supported(p)
    out = torch.empty(offsets_E.numel(), p.shape[1], q.shape[1], dtype=p.dtype, device=p.device)
    if p.shape[0] == 0:
        return out.zero_()
    return tuned_configs.run(p.t(), q, out, shape=("weight", *out.shape), rows=p.shape[0], cu_seqlens_k=_group_starts(offsets_E))
