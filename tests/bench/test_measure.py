"""Memory accounting and step timing on a tiny model (CPU)."""

from __future__ import annotations

import torch

from moetune.bench.measure import make_optimizer, measure_steps, state_bytes
from moetune.bench.models import build_side, load_config
from moetune.bench.run import tokens

CPU = torch.device("cpu")


def test_state_bytes_counts_params_grads_and_adamw_states():
    _, config = load_config("tiny", layers=2)
    bench = build_side("moetune", config, device=CPU, dtype=torch.bfloat16, seed=0)
    params = list(bench.model.parameters())
    param_bytes = sum(p.numel() * 2 for p in params)
    optimizer = make_optimizer(bench.model, lr=1e-5, device=CPU)
    before = state_bytes(bench.model, optimizer)
    assert before == {"params": param_bytes, "grads": param_bytes, "optimizer": 0, "total": 2 * param_bytes}

    ids = tokens(vocab_size=config.vocab_size, micro_batch=1, seq_len=16, seed=0, rank=0, device=CPU)
    bench.loss(ids).backward()
    optimizer.step()
    after = state_bytes(bench.model, optimizer)
    # bf16 exp_avg + exp_avg_sq per parameter, plus AdamW's fp32 scalar step counter per parameter
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    assert after["optimizer"] == 2 * param_bytes + 4 * len(params)
    assert after["total"] == 4 * param_bytes + 4 * len(params)


def test_measure_steps_reports_medians_and_losses():
    calls = []

    def forward_backward():
        calls.append("fb")
        return torch.tensor(float(len(calls)))

    def optimizer_step():
        calls.append("opt")

    times = measure_steps(forward_backward, optimizer_step, device=CPU, warmup=2, steps=3)
    assert calls == ["fb", "opt"] * 5
    assert len(times.all_step_s) == 3 and len(times.losses) == 3
    assert times.losses == [5.0, 7.0, 9.0]  # only measured steps are recorded
    assert 0 <= times.fwd_bwd_s <= times.step_s
