"""The MoE layer: router -> dispatch -> grouped experts -> combine (+ shared experts).

Each stage is a small replaceable part: ``gate`` (a router module), ``experts`` (a grouped-experts
module), ``dispatcher`` (a plain object, swapped by expert parallelism; it holds no parameters so
state dicts are unchanged; its ``run`` calls the experts between dispatch and combine, so a
pipelined dispatcher can split the work into chunks) and optional ``shared_experts``.
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.moe.dispatch import LocalTokenDispatcher, TokenDispatcher


class MoEBlock(nn.Module):
    """Sparse MoE block with Transformers' child names (``gate``, ``experts``, ``shared_experts``;
    the router is registered as ``router_name``, e.g. GPT-OSS's ``router``) in Transformers' order:
    the experts before the router (Qwen3-MoE, DeepSeek-V3, Nemotron-H in Transformers 5.10-5.25), or
    after it (``router_first``: GPT-OSS). ``parameters()`` then lists them as Transformers' model
    does, so an optimizer state saved from one loads into the other's parameters."""

    def __init__(
        self,
        *,
        gate: nn.Module,
        experts: nn.Module,
        num_experts: int,
        shared_experts: nn.Module | None = None,
        router_name: str = "gate",
        router_first: bool = False,
    ) -> None:
        super().__init__()
        self._router_name = router_name
        if router_first:
            self.register_module(router_name, gate)
        self.experts = experts
        if not router_first:
            self.register_module(router_name, gate)
        if shared_experts is not None:
            self.shared_experts = shared_experts
        self.num_experts = num_experts
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher()

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])
        routing = self._modules[self._router_name](x_TH)
        out_TH = self.dispatcher.run(x_TH, routing, self.experts, num_experts=self.num_experts).to(hidden_BSH.dtype)
        if getattr(self, "shared_experts", None) is not None:
            out_TH = out_TH + self.shared_experts(x_TH)
        return out_TH.view_as(hidden_BSH)
