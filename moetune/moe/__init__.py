"""The MoE layer's parts: routers, token dispatch, grouped experts, aux loss. See README.md."""

from moetune.moe.aux_loss import capture_router_logits, load_balancing_loss
from moetune.moe.dispatch import (
    LocalTokenDispatcher,
    TokenDispatcher,
    permute,
    sort_by_expert,
    sort_ids,
    unpermute,
)
from moetune.moe.experts import GroupedExperts
from moetune.moe.layer import MoEBlock
from moetune.moe.routing import (
    ROUTERS,
    GroupLimitedSigmoidRouter,
    Routing,
    SoftmaxTopKRouter,
    TopKThenSoftmaxRouter,
    balanced_assignment,
)

__all__ = [
    "GroupedExperts",
    "LocalTokenDispatcher",
    "MoEBlock",
    "Routing",
    "SoftmaxTopKRouter",
    "ROUTERS",
    "GroupLimitedSigmoidRouter",
    "TopKThenSoftmaxRouter",
    "TokenDispatcher",
    "balanced_assignment",
    "capture_router_logits",
    "load_balancing_loss",
    "permute",
    "sort_by_expert",
    "sort_ids",
    "unpermute",
]
