"""Rows: the cross product of settings, and a setting that runs out of memory does not stop the others."""

from __future__ import annotations

import torch

from moetune.bench.env import RunEnv
from moetune.bench.models import build_side, load_config
from moetune.bench.run import make_rows, run_rows

CPU = torch.device("cpu")


def test_rows_cover_every_setting():
    rows = make_rows(
        routings=["real", "balanced"], micro_batches=[1, 2], seq_len=64, activation_checkpointing=[False, True]
    )
    assert len(rows) == 8 and len({r.label for r in rows}) == 8


def test_an_oom_row_is_recorded_and_the_next_row_runs():
    _, config = load_config("tiny", layers=2)
    bench = build_side("moetune", config, device=CPU, dtype=torch.bfloat16, seed=0)
    real_loss = bench.loss

    def loss(input_ids):
        if input_ids.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_loss(input_ids)

    bench.loss = loss
    rows = make_rows(routings=["balanced"], micro_batches=[2, 1], seq_len=16, activation_checkpointing=[True])
    seen = []
    results = run_rows(
        bench, rows, env=RunEnv(CPU, 0, 1), flops_per_token={16: 1e6}, peak_tflops=None, warmup=1, steps=2,
        seed=0, lr=1e-5, on_result=seen.append,
    )
    assert [r.error for r in results] == ["OOM", None] and seen == results
    assert results[1].tokens_per_s_per_gpu > 0 and results[1].tflops_per_gpu > 0
    assert bench.activation_checkpointing is False  # switched off after every row
