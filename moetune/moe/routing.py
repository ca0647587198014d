"""Routers: which experts each token goes to, and with what weight.

Shape legend: T tokens, H hidden size, E routed experts, K experts per token (top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """The router's decision for a flat batch of tokens."""

    logits_TE: torch.Tensor
    """Raw router logits (model dtype); the aux loss and expert-load metrics read them."""
    weights_TK: torch.Tensor
    """Combine weight of each selected expert, in the model dtype."""
    experts_TK: torch.Tensor
    """Index (int64) of each selected expert."""


def balanced_assignment(
    num_tokens: int, *, num_experts: int, top_k: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark's balanced gate: flattened slot j of T x K goes to expert j mod E, weight 1/K.

    A pure function of the shape, so activation-checkpoint recomputation routes identically.
    """
    experts_TK = (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)
    weights_TK = torch.full((num_tokens, top_k), 1.0 / top_k, device=device, dtype=dtype)
    return weights_TK, experts_TK


class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE / Mixtral router: fp32 softmax over all experts, top-k, optional renormalisation.

    Numerically identical to Transformers' ``Qwen3MoeTopKRouter``; the parameter is ``weight`` [E, H].
    """

    def __init__(
        self, *, hidden_size: int, num_experts: int, top_k: int, normalize_top_k: bool, balanced: bool = False
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.balanced = balanced
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TH, self.weight)
        if self.balanced:
            weights_TK, experts_TK = balanced_assignment(
                x_TH.shape[0], num_experts=self.num_experts, top_k=self.top_k, device=x_TH.device, dtype=logits_TE.dtype
            )
            return Routing(logits_TE, weights_TK, experts_TK)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        top_probs_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.normalize_top_k:
            top_probs_TK = top_probs_TK / top_probs_TK.sum(dim=-1, keepdim=True)
        return Routing(logits_TE, top_probs_TK.to(logits_TE.dtype), experts_TK)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize_top_k}, balanced={self.balanced}"
