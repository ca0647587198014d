"""Targets outside the vocabulary, caught without stopping the GPU.

Transformers' loss indexes the logits with each target, so a label that is neither ``ignore_index``
nor in ``[0, vocab)`` (``-1`` used as "ignore", a token id from a larger tokenizer) fails there: an
IndexError on CPU, a device-side assert on CUDA. The fused loss's kernel reads one logit per row and
would instead return a finite, wrong loss. Checking the targets on the host every step would make the
host wait for each forward; so on CUDA the check runs on the device and its answer is read when the
next loss starts, by which time it has long arrived: the run stops with an error naming the labels one
step late, before a second bad step. On CPU it is checked at once. Inside a CUDA-graph capture no host
read can happen, and the check is skipped.
"""

from __future__ import annotations

import torch

# device -> (pinned flag, event after its copy, vocabulary size, ignore index) of the last loss's targets
_pending: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event, int, int]] = {}


def _out_of_range(targets_T: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    return ((targets_T < 0) & (targets_T != ignore_index)) | (targets_T >= vocab_size)


def _error(vocab_size: int, ignore_index: int, detail: str) -> ValueError:
    return ValueError(
        f"labels: every target must be a token id in [0, {vocab_size}) (the model's vocabulary) or "
        f"{ignore_index} (ignored); {detail}. Mask the positions that should not be scored with {ignore_index}, "
        "and resize the model's embeddings (model.resize_token_embeddings) if the tokenizer has more tokens."
    )


@torch.compiler.disable  # host-side bookkeeping (a pinned flag, an event): never traced into a compiled loss
def check_targets(targets_T: torch.Tensor, *, vocab_size: int, ignore_index: int) -> None:
    """Raise a ValueError naming the labels when a target lies outside the vocabulary: at once on CPU,
    from the previous call's targets on CUDA (see the module docstring)."""
    if targets_T.device.type != "cuda":
        bad = _out_of_range(targets_T, vocab_size, ignore_index)
        if bad.any():
            values = targets_T[bad].unique()[:5].tolist()
            raise _error(vocab_size, ignore_index, f"got {values}")
        return
    if torch.cuda.is_current_stream_capturing():
        return
    raise_for_previous_targets(targets_T.device)
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(_out_of_range(targets_T, vocab_size, ignore_index).any(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _pending[targets_T.device] = (flag, event, vocab_size, ignore_index)


def raise_for_previous_targets(device: torch.device) -> None:
    """The error for the targets the last loss on ``device`` took, once their check has arrived."""
    pending = _pending.pop(device, None)
    if pending is None:
        return
    flag, event, vocab_size, ignore_index = pending
    event.synchronize()  # recorded a step ago: long done, so this does not wait
    if bool(flag):
        raise _error(vocab_size, ignore_index, "the previous batch's labels had other values (found on the GPU "
                                               "after its step)")
