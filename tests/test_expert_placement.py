"""Load-balanced expert placement (moetune/distributed/placement.py) on CPU: the balancing rule, and
that relabelling leaves the model's function (logits, loss with aux loss, gradients up to the
relabelling) unchanged for Qwen3-MoE, GPT-OSS (router and expert biases, transposed experts) and
DeepSeek-V3 (score-correction bias, shared experts), that restoring gives back the original weights,
and that a saved relabelled model loads in plain Transformers with the same logits. Under expert
parallelism: tests/distributed (replicate_workers.rebalanced_experts_replicated)."""

from __future__ import annotations

import pytest
import torch
import transformers

import moetune
from moetune.distributed.placement import (
    balanced_expert_order,
    expert_loads,
    expert_order,
    rebalance_experts,
    restore_expert_order,
    rows_per_rank,
)
from moetune.moe.layer import MoEBlock
from tests.conftest import tiny_qwen3_moe_config
from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
from tests.test_gpt_oss_parity import tiny_gpt_oss_config

CONFIGS = {
    "qwen3_moe": lambda: tiny_qwen3_moe_config(),
    "gpt_oss": lambda: tiny_gpt_oss_config(),
    "deepseek_v3": lambda: tiny_deepseek_v3_config(n_group=1, topk_group=1),
}


def test_balanced_order_evens_out_the_blocks():
    loads = torch.tensor([10, 1, 1, 10, 5, 5, 3, 3])
    order = balanced_expert_order(loads, 2)
    assert sorted(order.tolist()) == list(range(8))
    blocks = rows_per_rank(loads[order], 2).tolist()
    assert blocks == [19, 19]  # contiguous: [17, 21]
    assert all(order.view(2, 4)[r].tolist() == sorted(order.view(2, 4)[r].tolist()) for r in range(2))
    assert balanced_expert_order(torch.ones(8), 1).tolist() == list(range(8))
    with pytest.raises(ValueError, match="8 experts do not split evenly over 3 ranks"):
        balanced_expert_order(loads, 3)


def test_a_placement_the_rule_would_not_improve_is_kept():
    """Greedy largest-first is not optimal: where the current blocks are already at least as even,
    the layer keeps its placement."""
    model = _model("qwen3_moe")
    name = next(n for n, m in model.named_modules() if isinstance(m, MoEBlock))
    even = torch.tensor([3, 3, 0, 0, 2, 2, 2, 0])  # blocks 6 / 6; the greedy rule gives 7 / 5
    assert rows_per_rank(even[balanced_expert_order(even, 2)], 2).tolist() == [7, 5]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.equal(rebalance_experts(model, {name: even}, num_ranks=2)[name], torch.arange(8))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _model(name: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = moetune.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random router / expert biases and score corrections, so that permuting them matters
        scores = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for tensor in [*model.parameters(), *scores]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return model


def _outputs(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    logits = model(input_ids=ids).logits.detach()
    return out.loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_relabelling_keeps_the_function_and_restores(name, tmp_path):
    model = _model(name)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Tokens whose loads make the rebalancing move experts (the assertion below): with some draws the
    # identity order is already the balanced one.
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    loss, logits, grads = _outputs(model, ids)
    loads = expert_loads(model, [{"input_ids": ids}])
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, MoEBlock)}
    assert loads.keys() == blocks.keys()
    assert all(int(c.sum()) == ids.numel() * model.config.num_experts_per_tok for c in loads.values())
    orders = rebalance_experts(model, loads, num_ranks=2)
    assert any(not torch.equal(order, torch.arange(order.numel())) for order in orders.values())
    new_loss, new_logits, new_grads = _outputs(model, ids)
    torch.testing.assert_close(new_loss, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(new_logits, logits, rtol=1e-5, atol=1e-6)
    for block_name, order in orders.items():  # the gradients are the old ones, relabelled
        for param_name, grad in new_grads.items():
            if param_name.startswith(block_name + ".") and grad.shape[:1] == (order.numel(),) and grad.dim() > 1:
                torch.testing.assert_close(grad, grads[param_name][order], rtol=1e-5, atol=1e-7, msg=param_name)
    # The relabelled model saved and loaded by plain Transformers computes the same logits.
    model.save_pretrained(tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, experts_implementation="eager")
    torch.testing.assert_close(plain(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
    restore_expert_order(model)
    for block in blocks.values():
        assert torch.equal(expert_order(block), torch.arange(block.num_experts))
        assert not hasattr(block._modules[block._router_name], "expert_slots")  # no reordering left
    for n, p in model.named_parameters():
        assert torch.equal(p, original[n]), n


def test_unsupported_models_are_refused():
    model = moetune.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(), dtype=torch.float32)  # n_group=4
    loads = {n: torch.arange(m.num_experts) for n, m in model.named_modules() if isinstance(m, MoEBlock)}
    with pytest.raises(ValueError, match="groups of consecutive experts"):
        rebalance_experts(model, loads, num_ranks=2)
    qwen = _model("qwen3_moe")
    with pytest.raises(ValueError, match="no MoE layer named"):
        rebalance_experts(qwen, {"model.layers.9.mlp": torch.ones(8)}, num_ranks=2)
    name = next(n for n, m in qwen.named_modules() if isinstance(m, MoEBlock))
    with pytest.raises(ValueError, match="has 3 entries for 8 experts"):
        rebalance_experts(qwen, {name: torch.ones(3)}, num_ranks=2)
