"""The MoE layer's parts and the fused LM-head loss against plain PyTorch formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetune.layers import linear_cross_entropy, shift_labels_for_causal_lm
from moetune.moe import GroupedExperts, MoEBlock, Routing, SoftmaxTopKRouter, permute, unpermute
from tests.conftest import rel_err


def test_permute_unpermute_is_weighted_sum_over_top_k():
    torch.manual_seed(0)
    x = torch.randn(7, 5)
    experts = torch.randint(0, 4, (7, 3))
    weights = torch.rand(7, 3)
    routing = Routing(torch.zeros(7, 4), weights, experts)
    x_sorted, counts, state = permute(x, routing, num_experts=4)
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=4).tolist()
    sorted_experts = experts.flatten()[state.order_N]
    assert torch.all(sorted_experts[1:] >= sorted_experts[:-1])
    # experts = "multiply by (expert id + 1)" makes the expected output easy to write down
    y = x_sorted * (sorted_experts + 1).unsqueeze(1)
    expected = sum(weights[:, k : k + 1] * x * (experts[:, k : k + 1] + 1) for k in range(3))
    torch.testing.assert_close(unpermute(y, state), expected)


def test_grouped_experts_loop_equals_per_token_formula():
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=3, hidden_size=6, intermediate_size=4)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(9, 6)
    counts = torch.tensor([4, 0, 5])
    y = experts(x, counts)
    ids = [0] * 4 + [2] * 5
    for row, e in enumerate(ids):
        gate, up = (experts.gate_up_proj[e] @ x[row]).chunk(2)
        torch.testing.assert_close(y[row], experts.down_proj[e] @ (F.silu(gate) * up))


def test_moe_block_gradients_reach_router_and_experts():
    torch.manual_seed(0)
    block = MoEBlock(
        gate=SoftmaxTopKRouter(hidden_size=8, num_experts=4, top_k=2, normalize_top_k=False),
        experts=GroupedExperts(num_experts=4, hidden_size=8, intermediate_size=6),
        num_experts=4,
    )
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    block(torch.randn(2, 3, 8)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters())


def test_router_rejects_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SoftmaxTopKRouter(hidden_size=4, num_experts=4, top_k=5, normalize_top_k=True)


@pytest.mark.parametrize("num_items", [None, 37])
@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_linear_cross_entropy_matches_materialised_logits(num_items, chunk_rows):
    torch.manual_seed(0)
    h = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 11))
    labels[0, :3] = -100
    targets = shift_labels_for_causal_lm(labels)
    logits = h @ w.t()
    reduction = "mean" if num_items is None else "sum"
    expected = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), ignore_index=-100, reduction=reduction)
    if num_items is not None:
        expected = expected / num_items
    (gh, gw) = torch.autograd.grad(expected * 3, (h, w))
    got = linear_cross_entropy(h.reshape(-1, 16), w, targets.reshape(-1), num_items_in_batch=num_items, chunk_rows=chunk_rows)
    (h2, w2) = torch.autograd.grad(got * 3, (h, w))
    assert rel_err(got, expected) < 1e-12
    assert rel_err(h2, gh) < 1e-12 and rel_err(w2, gw) < 1e-12


def test_linear_cross_entropy_under_autocast_matches_transformers_lm_head():
    """Under bf16 autocast with fp32 weights (the recipe's default precision on GPU) and several
    chunks: the GEMMs run in bf16 as autocast's nn.Linear would, the gradients come back in fp32."""
    torch.manual_seed(0)
    h = torch.randn(24, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (24,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, targets, chunk_rows=5)  # 5 chunks: in-place accumulation under autocast
        logits = torch.nn.functional.linear(h, w)
    assert logits.dtype == torch.bfloat16
    expected = torch.nn.functional.cross_entropy(logits.float(), targets)
    gh, gw = torch.autograd.grad(expected, (h, w))
    h2, w2 = torch.autograd.grad(got, (h, w))
    assert w2.dtype == torch.float32 and h2.dtype == torch.float32
    assert rel_err(got, expected) < 1e-3
    assert rel_err(h2, gh) < 2e-2 and rel_err(w2, gw) < 2e-2


def test_linear_cross_entropy_refuses_a_second_backward():
    """Its gradients are scaled in place and handed over: a second backward would scale them twice."""
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 10, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


@pytest.mark.parametrize("num_ids", [1, 128, 257, 40000])
def test_sort_ids_equals_stable_argsort_and_bincount(num_ids):
    """Narrowed keys (uint8 / int16 / int32) sort as the int64 ids do; counts from the sorted keys."""
    from moetune.moe import sort_ids

    torch.manual_seed(0)
    ids = torch.randint(0, num_ids, (3000,))
    ids[:5] = num_ids - 1  # the largest id is representable in the narrowed type
    order, counts = sort_ids(ids, num_ids)
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(ids, minlength=num_ids))


@pytest.mark.parametrize("counts", [[0, 0, 0, 0], [3, 0, 2, 1]], ids=["no-rows", "rows"])
@pytest.mark.parametrize("padding", [0, 2])
def test_experts_give_autocasts_dtype_with_or_without_rows(counts, padding):
    """Under autocast the experts' rows come out in autocast's dtype; a rank whose experts got no rows (or
    only padding) must give the same dtype, or the expert-parallel all-to-all that takes the rows back
    moves other byte counts on different ranks (gloo aborted: TRL's SFTTrainer, Nemotron-H, ep_size=2)."""
    from moetune.moe.experts import run_experts

    experts = GroupedExperts(num_experts=4, hidden_size=8, intermediate_size=4, activation="relu2", gated=False)
    torch.nn.init.normal_(experts.up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x = torch.randn(sum(counts) + padding, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run_experts(x, torch.tensor(counts), experts.up_proj, experts.down_proj, activate=experts._activate,
                        backend="loop")  # fmt: skip
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], 8)
    y.float().sum().backward()
    assert x.grad is not None and experts.up_proj.grad is not None
