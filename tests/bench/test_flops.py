"""The brief's FLOPs formula, including dense layers."""

from __future__ import annotations

import pytest

from moetune.bench.flops import flops_per_token
from moetune.bench.models import load_config


def test_qwen3_30b_a3b_is_about_23_gflop_per_token():
    _, config = load_config("qwen3_30b_a3b")
    assert config.num_hidden_layers == 48
    assert flops_per_token(config, seq_len=4096) == pytest.approx(23e9, rel=0.05)


def test_matches_the_formula_term_by_term():
    _, config = load_config("qwen3_30b_a3b", layers=8)
    h, q, kv, s = 2048, 32 * 128, 4 * 128, 4096
    layer = 2 * h * (q + 2 * kv + q) + 2 * s * q + 8 * 3 * 2 * h * 768
    assert flops_per_token(config, seq_len=s) == 3 * (8 * layer + 2 * h * 151936)


def test_dense_layers_use_the_dense_mlp_width():
    _, config = load_config("tiny")
    assert config.mlp_only_layers == [0]
    h, q, kv, s = 64, 4 * 16, 2 * 16, 128
    attention = 2 * h * (q + 2 * kv + q) + 2 * s * q
    dense, sparse = 3 * 2 * h * 128, 2 * 3 * 2 * h * 32
    expected = 3 * (3 * attention + dense + 2 * sparse + 2 * h * 512)
    assert flops_per_token(config, seq_len=s) == expected
    config.decoder_sparse_step = 2  # layers 1 (index) only; 0 is listed, 2 is off-step
    assert flops_per_token(config, seq_len=s) == 3 * (3 * attention + 2 * dense + sparse + 2 * h * 512)
