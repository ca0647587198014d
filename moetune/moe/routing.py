"""Routers: which experts each token goes to, and with what weight.

Shape legend: T tokens, H hidden size, E routed experts, K experts per token (top-k).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetune.kernels.router import softmax_topk


class Routing(NamedTuple):
    """The router's decision for a flat batch of tokens. A tuple whose first field is the logits, as
    Transformers' routers return them first: its output recording (``_can_record_outputs``'s
    ``router_logits``, index 0) reads moetune's routers as it reads its own."""

    logits_TE: torch.Tensor
    """Raw router logits (model dtype); the aux loss and expert-load metrics read them."""
    weights_TK: torch.Tensor
    """Combine weight of each selected expert (model dtype, or fp32 for routers that route in fp32)."""
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


def balanced_routing(logits_TE: torch.Tensor, top_k: int) -> Routing:
    """A router's decision under the balanced gate: its logits kept (aux loss, metrics), the
    assignment and 1/K weights from ``balanced_assignment``."""
    weights_TK, experts_TK = balanced_assignment(
        logits_TE.shape[0], num_experts=logits_TE.shape[-1], top_k=top_k, device=logits_TE.device, dtype=logits_TE.dtype
    )
    return Routing(logits_TE, weights_TK, experts_TK)


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
            return balanced_routing(logits_TE, self.top_k)
        # One Triton launch each way on CUDA (moetune.kernels.router); Transformers' torch ops elsewhere.
        weights_TK, experts_TK = softmax_topk(logits_TE, self.top_k, normalize=self.normalize_top_k)
        return Routing(logits_TE, weights_TK, experts_TK)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, normalize={self.normalize_top_k}, balanced={self.balanced}"


class GroupLimitedSigmoidRouter(nn.Module):
    """DeepSeek-V3 / Kimi-K2 router: sigmoid scores, experts chosen within the ``topk_group`` best
    of ``n_group`` expert groups (a group scores the sum of its two best experts) using the scores
    plus a load-balancing bias (``e_score_correction_bias``, updated outside backprop), weights from
    the unbiased scores, optionally renormalised, times ``routed_scaling_factor``.

    Numerically identical to Transformers' ``DeepseekV3TopkRouter`` + ``route_tokens_to_experts``;
    the weight and the bias stay fp32 (Transformers keeps them fp32 in bf16 models) and the
    routing runs in fp32.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        top_k_groups: int,
        normalize_top_k: bool,
        scaling_factor: float,
        balanced: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_experts % num_groups or not 0 < top_k_groups <= num_groups:
            raise ValueError(
                f"n_group={num_groups} must divide n_routed_experts={num_experts} and topk_group={top_k_groups} "
                f"must be in [1, n_group]"
            )
        if not 0 < top_k <= num_experts // num_groups * top_k_groups:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, experts in topk_group groups]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_groups = num_groups
        self.top_k_groups = top_k_groups
        self.normalize_top_k = normalize_top_k
        self.scaling_factor = scaling_factor
        self.balanced = balanced
        # ``dtype`` is what the installed Transformers' router creates its tensors in (``router_dtype``): fp32
        # where its class keeps ``gate.weight`` in fp32, else the default dtype (loading then keeps the
        # correction bias in fp32, as Transformers does). An fp32 weight where Transformers' is bf16 would
        # differ from its state dict, and an fp32 gradient among bf16 ones sends torch's
        # ``clip_grad_norm_`` down its per-tensor path (an fp32 norm scaling bf16 gradients).
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=dtype))

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TH.float(), self.weight.float())
        if self.balanced:
            return balanced_routing(logits_TE, self.top_k)
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias
        per_group = self.num_experts // self.num_groups
        group_scores_TG = choice_TE.view(-1, self.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups_TK = torch.topk(group_scores_TG, k=self.top_k_groups, dim=-1, sorted=False)[1]
        group_mask_TG = torch.zeros_like(group_scores_TG).scatter_(1, groups_TK, 1.0)
        expert_mask_TE = group_mask_TG.unsqueeze(-1).expand(-1, self.num_groups, per_group).reshape(-1, self.num_experts)
        choice_TE = choice_TE.masked_fill(~expert_mask_TE.bool(), float("-inf"))
        experts_TK = torch.topk(choice_TE, k=self.top_k, dim=-1, sorted=False)[1]
        weights_TK = scores_TE.gather(1, experts_TK)
        if self.normalize_top_k:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(logits_TE, weights_TK * self.scaling_factor, experts_TK)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, groups={self.top_k_groups}/{self.num_groups}, "
            f"normalize={self.normalize_top_k}, scale={self.scaling_factor}, balanced={self.balanced}"
        )


class TopKThenSoftmaxRouter(nn.Module):
    """GPT-OSS router: logits with a bias, the top-k logits, softmax over those k only (in the
    logits' dtype). Numerically identical to Transformers' ``GptOssTopKRouter``; parameters
    ``weight`` [E, H] and ``bias`` [E]."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int, balanced: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_local_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.balanced = balanced
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TH, self.weight, self.bias)
        if self.balanced:
            return balanced_routing(logits_TE, self.top_k)
        top_logits_TK, experts_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        return Routing(logits_TE, torch.softmax(top_logits_TK, dim=-1, dtype=top_logits_TK.dtype), experts_TK)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, balanced={self.balanced}"


ROUTERS: tuple[type[nn.Module], ...] = (SoftmaxTopKRouter, GroupLimitedSigmoidRouter, TopKThenSoftmaxRouter)
"""Every router class (router-logit capture, weight init and the balanced gate look for these)."""
