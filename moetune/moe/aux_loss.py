"""Switch-Transformer load-balancing loss and the router-logit capture that feeds it.

Shape legend: T tokens, E experts, K experts per token, L MoE layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from moetune.moe.routing import Routing


@contextlib.contextmanager
def capture_router_logits(model: nn.Module, router_type: type[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Collect every router's logits during one forward (hooks removed on exit, so recomputation
    under activation checkpointing does not append twice), with their columns in the Hub checkpoint's
    expert order when the experts were relabelled (``moetune.distributed.placement``)."""
    captured: list[torch.Tensor] = []

    def hook(module, _inputs, output: Routing) -> None:
        slots = getattr(module, "expert_slots", None)  # the slot of each Hub-checkpoint expert
        captured.append(output.logits_TE if slots is None else output.logits_TE.index_select(-1, slots))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, router_type)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """E * sum_e(fraction of assignments to e * mean router probability of e), over all layers.

    Equal to Transformers' ``load_balancing_loss_func``; padding tokens (mask 0) are excluded. With a
    process ``group`` (``global_aux_loss=True``) the counts and probability sums are summed over its
    ranks first, so every rank gets the loss of all the group's tokens, as one process on the whole
    batch would; the sum of probabilities is all-reduced with autograd, so each rank's router
    gradient, averaged over the ranks like every gradient, is the whole batch's.
    """
    device = router_logits[0].device
    assigned_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits_TE in router_logits:
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        experts_TK = torch.topk(probs_TE, top_k, dim=-1).indices
        if attention_mask is None:
            mask_T = torch.ones(probs_TE.shape[0], dtype=torch.float32, device=device)
        else:
            mask_T = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        assigned_E = assigned_E.scatter_add(0, experts_TK.reshape(-1), mask_T.repeat_interleave(top_k))
        prob_sum_E = prob_sum_E + (probs_TE * mask_T.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask_T.sum()
    if group is not None:
        counts = torch.cat([assigned_E, rows.reshape(1)])
        dist.all_reduce(counts, group=group)
        assigned_E, rows = counts[:-1], counts[-1]
        prob_sum_E = differentiable_all_reduce(prob_sum_E, group=group)
    return num_experts * torch.sum((assigned_E / rows) * (prob_sum_E / rows))
