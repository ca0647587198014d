"""LM head + cross-entropy without materialising the full [tokens, vocab] logits.

With a 151,936-token vocabulary one micro-batch of 4096 tokens has 2.5 GB of fp32 logits plus
their gradient. Here the head and the loss run chunk by chunk and the gradients of the hidden
states and of the head weight are computed in the forward pass (the loss is a scalar, so the
backward only scales them), so at most one chunk of logits exists at a time.

Semantics equal Transformers' ``ForCausalLMLoss`` (logits upcast to fp32, ``ignore_index``,
mean over valid targets or sum / ``num_items_in_batch``).

Shape legend: T tokens, H hidden, V vocabulary, C rows in one chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moetune.kernels.cross_entropy import cross_entropy_grad_, scale_unless_one_
from moetune.layers.target_check import check_targets

IGNORE_INDEX = -100


def shift_labels_for_causal_lm(labels_BS: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position s predicts token s+1; the last position of each row predicts nothing."""
    return F.pad(labels_BS, (0, 1), value=ignore_index)[..., 1:]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, targets_T, normalizer, chunk_rows: int, ignore_index: int):
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(w_VH.dtype, torch.float32)  # fp32 for bf16 models, fp64 stays fp64
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h_TH.device)
        grad_h_TH = grad_w_VH = None
        with gemm_operands(h_TH, w_VH) as (h_TH_c, w_VH_c):
            grad_h_TH = torch.empty_like(h_TH_c) if needs_h else None
            for start in range(0, h_TH.shape[0], chunk_rows):
                h_CH = h_TH_c[start : start + chunk_rows]
                targets_C = targets_T[start : start + chunk_rows]
                # Logits in the model dtype, as Transformers' lm_head makes them; the kernel upcasts
                # inside and overwrites them with d(loss)/d(logits).
                logits_CV = h_CH @ w_VH_c.t()
                loss_sum += cross_entropy_grad_(logits_CV, targets_C, normalizer, ignore_index=ignore_index).sum()
                if not (needs_h or needs_w):
                    continue
                # Both GEMMs run in the model dtype on tensor cores with fp32 accumulation inside; the
                # head's gradient is accumulated across the few chunks by the GEMM itself (beta=1),
                # not through an fp32 buffer of the head's size.
                if needs_h:
                    grad_h_TH[start : start + chunk_rows] = logits_CV @ w_VH_c
                if needs_w:
                    grad_w_VH = accumulate_head_grad(grad_w_VH, logits_CV.t(), h_CH)
        ctx.save_for_backward(*as_dtypes((grad_h_TH, h_TH.dtype), (grad_w_VH, w_VH.dtype)))
        ctx.used = False
        return loss_sum / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        return *saved_gradients_scaled(ctx, grad_loss), None, None, None, None


@contextlib.contextmanager
def gemm_operands(h: torch.Tensor, w: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The LM head's GEMM operands in the dtype they run in, with autocast off inside: autocast's
    dtype where it is on (what ``nn.Linear`` would compute in; in-place GEMMs such as ``addmm_`` are
    not autocast, so every operand is cast once here), else their own."""
    device_type = h.device.type
    if not torch.is_autocast_enabled(device_type):
        yield h, w
        return
    dtype = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        yield h.to(dtype), w.to(dtype)


def accumulate_head_grad(grad: torch.Tensor | None, dlogits_t: torch.Tensor, h_CH: torch.Tensor, *,
                         alpha: float = 1.0) -> torch.Tensor:
    """``grad + alpha * dlogits_t @ h_CH`` by the GEMM itself (beta = 1), or the first term."""
    if grad is None:  # beta=0: the empty tensor's contents are ignored, NaNs included
        return torch.empty(dlogits_t.shape[0], h_CH.shape[1], dtype=h_CH.dtype, device=h_CH.device).addmm_(
            dlogits_t, h_CH, beta=0, alpha=alpha)
    return grad.addmm_(dlogits_t, h_CH, alpha=alpha)


def as_dtypes(*pairs: tuple[torch.Tensor | None, torch.dtype]) -> list[torch.Tensor | None]:
    """Each tensor cast to its dtype (gradients back to their parameters' dtypes under autocast)."""
    return [None if t is None else t.to(dtype) for t, dtype in pairs]


def saved_gradients_scaled(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of a fused loss whose forward saved (d loss / d hidden, d loss / d head weight):
    both scaled by the loss's incoming gradient. They are scaled in place and handed to autograd (no
    copy of the head's gradient), so they can serve one backward only."""
    if ctx.used:
        raise RuntimeError("the fused LM-head loss supports one backward per forward (retain_graph is not supported)")
    ctx.used = True
    grad_h_TH, grad_w_VH = ctx.saved_tensors
    grad_h = scale_unless_one_(grad_h_TH, grad_loss) if grad_h_TH is not None else None
    grad_w = scale_unless_one_(grad_w_VH, grad_loss) if grad_w_VH is not None else None
    return grad_h, grad_w


def loss_normalizer(
    hidden_TH: torch.Tensor, weight_dtype: torch.dtype, targets_T: torch.Tensor, *,
    num_items_in_batch: int | torch.Tensor | None, ignore_index: int, vocab_size: int,
) -> torch.Tensor:
    """What the summed token losses are divided by: the count of valid targets, or Transformers'
    gradient-accumulation ``num_items_in_batch``; a scalar in the loss's accumulation dtype on the
    hidden states' device. Also checks that there is one target per hidden row, and that every target
    is ``ignore_index`` or in the vocabulary (``moetune.layers.target_check``)."""
    if hidden_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"hidden states have {hidden_TH.shape[0]} rows but targets have {targets_T.shape[0]}")
    check_targets(targets_T, vocab_size=vocab_size, ignore_index=ignore_index)
    acc_dtype = torch.promote_types(weight_dtype, torch.float32)
    if num_items_in_batch is None:
        return (targets_T != ignore_index).sum().to(acc_dtype)
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.to(device=hidden_TH.device, dtype=acc_dtype)
    # A fill on the device: torch.tensor(number, device=cuda) is a blocking copy from the host,
    # which makes the host wait for the whole forward before it queues the loss.
    return torch.full((), float(num_items_in_batch), device=hidden_TH.device, dtype=acc_dtype)


def linear_cross_entropy(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden_TH @ weight_VH.T`` against ``targets_T`` in vocabulary chunks of rows.

    ``num_items_in_batch`` (Transformers' gradient-accumulation normaliser) turns the mean into a
    sum divided by it. A head split by vocabulary rows (a DTensor weight, ``vocab_parallel=True``)
    computes its loss itself: ``lm_head_cross_entropy`` takes either kind of head.
    """
    if isinstance(weight_VH, DTensor):
        raise TypeError(
            "linear_cross_entropy takes a whole LM head weight, got a DTensor (a vocabulary-parallel head's shard): "
            "call lm_head_cross_entropy(head, ...) with the head module, which runs the split loss"
        )
    normalizer = loss_normalizer(hidden_TH, weight_VH.dtype, targets_T, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, vocab_size=weight_VH.shape[0])  # fmt: skip
    if chunk_rows is None:
        # About 512 MiB of logits per chunk (a few chunks per 4k-token micro-batch on GPU).
        chunk_rows = max(1, (1 << 29) // (weight_VH.shape[0] * weight_VH.element_size()))
    return _LinearCrossEntropy.apply(hidden_TH, weight_VH, targets_T, normalizer, chunk_rows, ignore_index)


def lm_head_cross_entropy(
    head: torch.nn.Module,
    hidden_TH: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The fused loss of an LM head module: its own ``fused_cross_entropy`` where parallelism gave it
    one (``vocab_parallel=True`` mixes it into the head's class, so model code never imports the
    distributed implementation), else ``linear_cross_entropy`` of its weight."""
    options = {"num_items_in_batch": num_items_in_batch, "ignore_index": ignore_index, "chunk_rows": chunk_rows}
    own_loss = getattr(head, "fused_cross_entropy", None)
    if own_loss is not None:
        return own_loss(hidden_TH, targets_T, **options)
    return linear_cross_entropy(hidden_TH, head.weight, targets_T, **options)
