"""moetune's grouped experts apply LoRA adapters to the activations (x W^T + s (x A^T) B^T per expert
group): equal to the folded weight W + s B @ A, values and gradients, on every experts layout and
backend, with gathered rows and padding slots, and without forming W + s B @ A."""

from __future__ import annotations

import pytest
import torch

from moetune.lora.experts import add_expert_adapters
from moetune.moe.experts import run_experts
from tests.conftest import rel_err
from tests.test_gathered_experts import KINDS, autograd_nodes, make_experts, routed_slots

SCALING = 0.75


def adapted_experts(kind: str, backend: str, rank: int, *, num_experts=4, hidden=16, width=8):
    experts = make_experts(kind, backend=backend, num_experts=num_experts, hidden=hidden, width=width)
    add_expert_adapters(experts, experts.weight_names, rank=rank, scaling=SCALING, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if name.startswith("lora_"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    for name, param in experts.named_parameters():
        param.requires_grad_(name.startswith("lora_") or name.endswith("_bias"))  # apply_lora freezes the weights
    return experts


def folded_reference(experts, x, counts_E):
    """The same experts with W + s * B @ A formed first (through autograd), on the loop backend."""
    weights = []
    for name in experts.weight_names:
        weight = experts._parameters[name]
        weight = weight.transpose(-2, -1) if experts.is_transposed else weight  # [E, out, in]
        a, b = experts._parameters[f"lora_A_{name}"], experts._parameters[f"lora_B_{name}"]
        weights.append(weight + SCALING * torch.bmm(b, a))
    biases = {}
    if experts.has_bias:
        biases = {"in_bias": experts._parameters[f"{experts.weight_names[0]}_bias"], "down_bias": experts.down_proj_bias}
    return run_experts(x, counts_E, *weights, activate=experts._activate, backend="loop", **biases)


@pytest.mark.parametrize("rank", [3, 8], ids=["rank3_padded", "rank8"])
@pytest.mark.parametrize("gathered", [False, True], ids=["sorted_rows", "gathered_with_padding"])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "triton"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_adapters_on_activations_equal_the_folded_weight(kind, backend, gathered, rank):
    experts = adapted_experts(kind, backend, rank)
    num_tokens, top_k = 7, 3
    order_N, counts_E = routed_slots(num_tokens, top_k, num_local=4, num_remote=3 if gathered else 0)
    num_valid = int(counts_E.sum())
    x_TH = torch.randn(num_tokens, 16, requires_grad=True)
    probe = torch.randn(num_tokens * top_k, 16)
    if gathered:
        y = experts(x_TH, counts_E, gather_order=order_N, gather_top_k=top_k)[:num_valid]
    else:
        y = experts(x_TH[order_N[:num_valid] // top_k], counts_E)
    y_ref = folded_reference(experts, x_TH[order_N[:num_valid] // top_k], counts_E)

    # The adapted weight is never formed: no batched W + s * B @ A in the graph.
    assert not {"BaddbmmBackward0", "BmmBackward0"} & autograd_nodes(y)
    trained = [x_TH, *(p for p in experts.parameters() if p.requires_grad)]
    grads = torch.autograd.grad(y, trained, probe[:num_valid])
    grads_ref = torch.autograd.grad(y_ref, trained, probe[:num_valid])
    names = ["x", *(n for n, p in experts.named_parameters() if p.requires_grad)]
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for name, got, expected in zip(names, grads, grads_ref):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_frozen_weights_get_no_gradient_and_the_property_stays_plain():
    experts = adapted_experts("gated", "grouped_mm", rank=4)
    order_N, counts_E = routed_slots(5, 2, num_local=4, num_remote=0)
    x = torch.randn(10, 16)[order_N]
    y = experts(x, counts_E)
    y.backward(torch.randn_like(y))  # (torch's grouped GEMM backward refuses sum()'s expanded gradient)
    assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None
    assert experts._parameters["lora_A_gate_up_proj"].grad is not None
    assert experts.gate_up_proj is experts._parameters["gate_up_proj"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's grouped GEMM in bf16)")
@pytest.mark.parametrize("rank", [4, 16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_adapters_on_activations_in_bf16_on_cuda(kind, rank):
    """The CUDA grouped-GEMM path in bf16 (rank 4 zero-padded to 8) against the folded weight in fp32."""
    experts = adapted_experts(kind, "auto", rank, num_experts=8, hidden=256, width=128)
    with torch.no_grad():  # pre-activations of about one unit, away from the clamp of GPT-OSS's SwiGLU (at 7),
        for name, param in experts.named_parameters():  # where bf16 rounding flips clamped units and gradients
            if not name.endswith("_bias"):
                param.mul_(0.2 if name in experts.weight_names else 0.3)
    num_tokens, top_k = 96, 2
    order_N, counts_E = routed_slots(num_tokens, top_k, num_local=8, num_remote=2)
    num_valid = int(counts_E.sum())
    x_TH = torch.randn(num_tokens, 256)
    probe = torch.randn(num_valid, 256)
    reference = folded_reference(experts, x_TH[order_N[:num_valid] // top_k].requires_grad_(), counts_E)
    trained_ref = [p for p in experts.parameters() if p.requires_grad]
    grads_ref = torch.autograd.grad(reference, trained_ref, probe)

    experts = experts.to(device="cuda", dtype=torch.bfloat16)
    x_cuda = x_TH.to("cuda", torch.bfloat16)
    y = experts(x_cuda, counts_E.cuda(), gather_order=order_N.cuda(), gather_top_k=top_k)[:num_valid]
    trained = [p for p in experts.parameters() if p.requires_grad]
    grads = torch.autograd.grad(y, trained, probe.to("cuda", torch.bfloat16))
    assert rel_err(y.float().cpu(), reference) < 1e-2
    for got, expected in zip(grads, grads_ref):
        assert rel_err(got.float().cpu(), expected) < 2e-2
