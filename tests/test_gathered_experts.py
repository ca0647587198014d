"""The experts' gathered-input path (``gather_order=``): equal to gathering first, with padding slots
whose gradient never reaches the tokens, and without keeping the gathered rows for the backward.

On CPU the grouped-GEMM path runs on torch's CPU ``_grouped_mm`` (its padding rows are uninitialised
memory there too); the GPU tests check bf16 on CUDA and the memory saved."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels import moe_permute
from moetune.moe import GroupedExperts, LocalTokenDispatcher, Routing, TokenDispatcher
from tests.conftest import rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")

KINDS = {
    "gated": dict(gated=True, activation="silu"),
    "plain": dict(gated=False, activation="relu2"),
    "transposed_bias": dict(gated=True, activation="clamped_swiglu", transposed=True, bias=True),
}


def make_experts(
    kind: str, *, backend: str, num_experts: int, hidden: int, width: int, device="cpu", dtype=torch.float32
) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(
        num_experts=num_experts, hidden_size=hidden, intermediate_size=width, backend=backend, **KINDS[kind]
    )
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return experts.to(device=device, dtype=dtype)


def routed_slots(num_tokens: int, top_k: int, *, num_local: int, num_remote: int, device="cpu"):
    """Routing over ``num_local`` experts held here and ``num_remote`` held elsewhere (the all-gather
    dispatcher's view): the slots sorted by expert, the local experts' first; counts of local experts."""
    gen = torch.Generator().manual_seed(1)
    experts_TK = torch.rand(num_tokens, num_local + num_remote, generator=gen).argsort(dim=-1)[:, :top_k]
    experts_N = experts_TK.reshape(-1)
    order_N = torch.argsort(experts_N, stable=True)
    counts_E = torch.bincount(experts_N, minlength=num_local + num_remote)[:num_local]
    return order_N.to(device), counts_E.to(device)


def autograd_nodes(t: torch.Tensor) -> set[str]:
    """Names of the backward nodes that produced ``t``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(fn for fn, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def grads_of(y_NH, probe_NH, x, experts):
    return torch.autograd.grad(y_NH, [x, *experts.parameters()], probe_NH)


def check_gathered_equals_plain(kind, backend, *, num_remote, device="cpu", dtype=torch.float32):
    num_tokens, top_k, num_local, hidden, width = 7, 3, 4, 16, 8
    if device == "cuda":  # few rows per expert: the bias gradients' bf16 atomic sums stay close
        num_tokens, top_k, num_local, hidden, width = 64, 2, 8, 512, 256
    experts = make_experts(
        kind, backend=backend, num_experts=num_local, hidden=hidden, width=width, device=device, dtype=dtype
    )
    order_N, counts_E = routed_slots(num_tokens, top_k, num_local=num_local, num_remote=num_remote, device=device)
    num_valid = int(counts_E.sum())
    x_TH = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    probe_NH = torch.randn(num_tokens * top_k, hidden, device=device, dtype=dtype)
    # The caller never reads padding rows. Their upstream gradient is NaN on the grouped-GEMM path (the
    # rows are never multiplied into anything there); the loop's zero padding rows multiply theirs by 0.
    probe_NH[num_valid:] = float("nan") if backend != "loop" else 1e4

    y_NH = experts(x_TH, counts_E, gather_order=order_N, gather_top_k=top_k)
    grads = grads_of(y_NH, probe_NH, x_TH, experts)
    # Reference: the valid rows only, gathered first, through the plain path.
    y_ref = experts(x_TH[order_N[:num_valid] // top_k], counts_E)
    grads_ref = grads_of(y_ref, probe_NH[:num_valid], x_TH, experts)

    assert y_NH.shape == (num_tokens * top_k, hidden)
    names = ["output", "x", *(name for name, _ in experts.named_parameters())]
    for name, got, expected in zip(names, (y_NH[:num_valid], *grads), (y_ref, *grads_ref)):
        assert torch.isfinite(got).all(), name
        if device == "cuda":  # the same bf16 GEMMs on the same rows; sums in another order
            assert rel_err(got, expected) < 1e-2, name
        else:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("num_remote", [0, 3], ids=["no_padding", "padding"])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "triton"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_gathered_input_equals_gathering_first(kind, backend, num_remote):
    check_gathered_equals_plain(kind, backend, num_remote=num_remote)


def test_gathered_grouped_mm_keeps_no_gathered_copy():
    """The plain path saves the [N, H] gathered rows for the first GEMM's weight gradient; the gathered
    path saves no tensor holding them (it keeps the [T, H] tokens and gathers again in backward)."""
    num_tokens, top_k = 5, 2
    experts = make_experts("gated", backend="grouped_mm", num_experts=4, hidden=12, width=4)
    order_N, counts_E = routed_slots(num_tokens, top_k, num_local=4, num_remote=0)
    x_TH = torch.randn(num_tokens, 12, requires_grad=True)
    x_NH = x_TH.detach()[order_N // top_k]

    def saves_gathered_rows(run) -> bool:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            run()
        return any(t.shape == x_NH.shape and torch.equal(t, x_NH) for t in saved)

    assert saves_gathered_rows(lambda: experts(x_TH[order_N // top_k], counts_E))
    assert not saves_gathered_rows(lambda: experts(x_TH, counts_E, gather_order=order_N, gather_top_k=top_k))


def test_gather_order_shape_is_checked():
    experts = make_experts("gated", backend="loop", num_experts=4, hidden=16, width=8)
    with pytest.raises(ValueError, match="gather_order must list the 2 routed slots"):
        experts(torch.randn(5, 16), torch.tensor([3, 3, 2, 1]), gather_order=torch.arange(9), gather_top_k=2)
    with pytest.raises(TypeError, match="int32 or int64"):
        experts(torch.randn(5, 16), torch.tensor([3, 3, 2, 2]), gather_order=torch.arange(10.0), gather_top_k=2)


def _routing(num_tokens: int, top_k: int, num_experts: int) -> Routing:
    gen = torch.Generator().manual_seed(2)
    experts_TK = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    weights_TK = torch.rand(num_tokens, top_k, generator=gen).requires_grad_()
    return Routing(torch.zeros(num_tokens, num_experts), weights_TK, experts_TK)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "triton"])
@pytest.mark.parametrize("num_tokens", [9, 0])
def test_local_dispatcher_gathers_inside_the_experts(backend, num_tokens):
    """``LocalTokenDispatcher.run`` (experts gather their rows) equals dispatch -> experts -> combine,
    also with no tokens (the experts' weights still join the graph)."""
    experts = make_experts("gated", backend=backend, num_experts=4, hidden=16, width=8)
    routing = _routing(num_tokens, 2, 4)
    x_TH = torch.randn(num_tokens, 16, requires_grad=True)
    inputs = [x_TH, routing.weights_TK, *experts.parameters()]
    dispatcher = LocalTokenDispatcher()
    out = dispatcher.run(x_TH, routing, experts, num_experts=4)
    expected = TokenDispatcher.run(dispatcher, x_TH, routing, experts, num_experts=4)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    for got, ref in zip(torch.autograd.grad(out.sum(), inputs), torch.autograd.grad(expected.sum(), inputs)):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_local_dispatcher_passes_sorted_rows_to_other_experts():
    routing = _routing(6, 2, 4)
    seen = []

    def experts(x_NH, counts_E):
        seen.append(x_NH.shape)
        return 2 * x_NH

    x_TH = torch.randn(6, 8)
    out = LocalTokenDispatcher().run(x_TH, routing, experts, num_experts=4)
    assert seen == [(12, 8)]
    torch.testing.assert_close(out, 2 * x_TH * routing.weights_TK.detach().sum(-1, keepdim=True))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_remote", [0, 4], ids=["no_padding", "padding"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_gathered_input_equals_gathering_first_bf16_cuda(kind, backend, num_remote):
    check_gathered_equals_plain(kind, backend, num_remote=num_remote, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gathered_input_saves_the_gathered_rows_memory_cuda():
    """Qwen3-30B-A3B-like layer, 4096 tokens x 8: what the forward keeps for the backward is smaller by
    the [N, H] bf16 gathered rows (x_TH is a leaf, held anyway); no host sync in forward + backward."""
    num_tokens, top_k, num_experts, hidden = 4096, 8, 128, 2048
    experts = make_experts(
        "gated", backend="auto", num_experts=num_experts, hidden=hidden, width=768, device="cuda", dtype=torch.bfloat16
    )
    order_N, counts_E = routed_slots(num_tokens, top_k, num_local=num_experts, num_remote=0, device="cuda")
    x_TH = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(run) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y_NH = run()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - y_NH.numel() * y_NH.element_size()
        torch.autograd.grad(y_NH, [x_TH, *experts.parameters()], torch.ones_like(y_NH))
        return kept

    plain = lambda: experts(moe_permute(x_TH, order_N, top_k), counts_E)  # noqa: E731
    gathered = lambda: experts(x_TH, counts_E, gather_order=order_N, gather_top_k=top_k)  # noqa: E731
    saved_bytes(plain), saved_bytes(gathered)  # warm up: Triton compiles, allocator caches
    gathered_rows = num_tokens * top_k * hidden * 2
    difference = saved_bytes(plain) - saved_bytes(gathered)
    assert abs(difference - gathered_rows) < 0.05 * gathered_rows, (difference, gathered_rows)

    torch.cuda.set_sync_debug_mode("error")
    try:
        y_NH = gathered()
        assert "GatheredGroupedMMBackward" in autograd_nodes(y_NH)
        torch.autograd.grad(y_NH, [x_TH, *experts.parameters()], torch.ones_like(y_NH))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", list(KINDS))
def test_fp32_experts_under_bf16_autocast_take_the_grouped_gemm_without_host_sync(kind):
    """fp32 weights under CUDA bf16 autocast (the recipe's default precision on GPU): the grouped GEMM
    in bf16, as autocast's per-expert nn.Linear would compute (the loop path's result, within bf16
    rounding), with no host read of the split sizes (a CUDA-graph capture depends on it)."""
    kwargs = dict(num_experts=4, hidden=64, width=32, device="cuda", dtype=torch.float32)
    grouped, loop = make_experts(kind, backend="auto", **kwargs), make_experts(kind, backend="loop", **kwargs)
    counts_E = torch.tensor([5, 0, 9, 2], device="cuda")
    x_NH = torch.randn(16, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = loop(x_NH, counts_E)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = grouped(x_NH, counts_E)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), expected.float()) < 1e-2
