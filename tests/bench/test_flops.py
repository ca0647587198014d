"""The brief's FLOPs formula, including dense layers."""

from __future__ import annotations

import pytest

from moetune.bench.models import load_config
from moetune.flops import training_flops_per_token as flops_per_token


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


def test_other_families_count_their_own_shapes():
    """DeepSeek-V3: the routed experts count top-k times one expert; GPT-OSS: sliding-window layers
    see about the window, not half the sequence."""
    import transformers

    from moetune.flops import training_flops_per_token

    deepseek = transformers.DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1)
    top8 = training_flops_per_token(deepseek, seq_len=4096)
    deepseek.num_experts_per_tok = 4
    expert = 3 * 2 * 7168 * 2048  # gate, up and down of one expert, 2 FLOPs per weight
    assert top8 - training_flops_per_token(deepseek, seq_len=4096) == 3 * 4 * expert
    gpt_oss = transformers.GptOssConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    full = transformers.GptOssConfig(num_hidden_layers=2, layer_types=["full_attention", "full_attention"])
    scores_per_full_layer = 2 * 2048 * 64 * (64 + 64)  # keys S/2, heads, qk + v dims
    saved = training_flops_per_token(full, seq_len=4096) - training_flops_per_token(gpt_oss, seq_len=4096)
    assert saved == pytest.approx(3 * (scores_per_full_layer - 2 * (128 - 128 * 127 / 8192) * 64 * 128))


def test_packed_documents_count_attention_at_their_own_length():
    from moetune.flops import FlopsCounter

    _, config = load_config("qwen3_30b_a3b", layers=8)
    counter = FlopsCounter(config)
    h, q, kv = 2048, 32 * 128, 4 * 128
    weights = 3 * (8 * (2 * h * (q + 2 * kv + q) + 8 * 3 * 2 * h * 768) + 2 * h * 151936)
    attention_per_key = 3 * 8 * 2 * q  # per token per key position seen (S / 2 keys on average)
    assert counter.of_documents([1000, 3096]) == sum(n * (weights + attention_per_key * n) for n in (1000, 3096))
    assert counter.of_documents([1000, 3096]) < 4096 * counter.per_token(4096)  # no attention across documents
    assert counter.of_documents([4096]) == 4096 * flops_per_token(config, seq_len=4096)


def test_frozen_weights_count_no_weight_gradients():
    """LoRA's count: the weights' forward and input gradients (2x), attention's forward and backward (3x)."""
    from moetune.flops import FlopsCounter

    _, config = load_config("qwen3_30b_a3b", layers=8)
    h, q, kv, s = 2048, 32 * 128, 4 * 128, 4096
    weights = 8 * (2 * h * (q + 2 * kv + q) + 8 * 3 * 2 * h * 768) + 2 * h * 151936
    attention = 8 * 2 * s * q
    assert flops_per_token(config, seq_len=s, frozen_weights=True) == 2 * weights + 3 * attention
    counter = FlopsCounter(config)
    assert counter.of_documents([1000, 3096], frozen_weights=True) == sum(
        n * counter.per_token(n, frozen_weights=True) for n in (1000, 3096))


def test_mamba2_mixers_count_the_ssm_scan_as_nemotron_does(monkeypatch):
    """Megatron / NeMo's hybrid-model convention: each Mamba-2 layer's scan adds 7 x d_inner x state
    per token (training), beside its projections, which count as linears."""
    import moetune.flops
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    config = tiny_nemotron_h_config(hybrid_override_pattern="ME*M")  # two Mamba-2 layers
    with_scan = moetune.flops.FlopsCounter(config).per_token(16)
    monkeypatch.setattr(moetune.flops, "_is_ssm_mixer", lambda module: False)
    without = moetune.flops.FlopsCounter(config).per_token(16)
    d_inner, state = 4 * 8, 8  # mamba_num_heads x mamba_head_dim, ssm_state_size
    assert with_scan - without == pytest.approx(2 * 7 * d_inner * state)


def test_mamba2_convolutions_are_not_counted_as_experts(monkeypatch):
    """Mamba-2's conv1d weight is 3-D [C, 1, K] like stacked experts' weights; convolutions are left
    out (not counted top-k times as one expert)."""
    import moetune.flops
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    config = tiny_nemotron_h_config(hybrid_override_pattern="M*")  # one Mamba-2 layer, one attention layer
    monkeypatch.setattr(moetune.flops, "_is_ssm_mixer", lambda module: False)
    h, q, kv, d_inner, groups, state, heads = 32, 32, 16, 32, 2, 8, 4
    mamba = 2 * h * (2 * d_inner + 2 * groups * state + heads) + 2 * d_inner * h  # in_proj, out_proj
    attention = 2 * h * (q + 2 * kv + q) + 2 * 16 * q
    assert moetune.flops.FlopsCounter(config).per_token(16) == 3 * (mamba + attention + 2 * h * 96)


def test_a_window_the_config_gives_every_layer_is_counted():
    """Mistral / Mixtral pass ``config.sliding_window`` to every layer's attention (no per-layer
    attribute); Qwen2-MoE windows only the layers its ``layer_types`` marks."""
    import transformers

    from moetune.flops import FlopsCounter

    shapes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
    mixtral = FlopsCounter(transformers.MixtralConfig(**shapes, num_local_experts=4, sliding_window=16))
    assert dict(mixtral.attention_per_key) == {16: 2 * 2 * 4 * (8 + 8)}
    assert FlopsCounter(transformers.MixtralConfig(**shapes, sliding_window=None)).attention_per_key.keys() == {None}
    qwen2_moe = transformers.Qwen2MoeConfig(**shapes, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    windows = [kind == "sliding_attention" for kind in qwen2_moe.layer_types]
    assert sorted(FlopsCounter(qwen2_moe).attention_per_key, key=str) == sorted(
        {16 if w else None for w in windows}, key=str)


def test_gpt2_style_models_count_their_conv1d_weights_and_attention():
    """Transformers' ``Conv1D`` (GPT-2's linear layer) counts as a linear; its attention (``c_proj``, no
    ``o_proj``) counts its scores and values."""
    import transformers

    from moetune.flops import training_flops_per_token

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    h, s = 32, 16
    layer = 2 * h * (3 * h) + 2 * h * h + 2 * 2 * h * (4 * h) + 2 * s * h  # c_attn, c_proj, MLP, scores
    assert training_flops_per_token(config, seq_len=s) == 3 * (2 * layer + 2 * h * 64)
