"""Expert parallelism + FSDP2 on CPU under gloo: parity with one process, saving, resuming, bad input.

Each test spawns one group of processes (forked from a forkserver that imports torch and moetune
once, ~10 s for the first group) and runs several checks in it. The checks themselves are in
workers.py (replicate_workers.py for the replicated, CUDA-graph capturable setting); the global-loss
definition in helpers.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import moetune
from tests.conftest import save_per_expert_checkpoint, tiny_qwen3_moe_config
from tests.distributed import replicate_workers, vocab_parallel_workers, workers
from tests.distributed.helpers import spawn

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny Qwen3-MoE (3 layers, the middle one dense; 8 experts, top-2; fp32) in the Hub's
    per-expert layout. No aux loss: under EP each rank's aux loss sees only its own tokens."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False))
    return str(save_per_expert_checkpoint(model, tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def two_experts_checkpoint(tmp_path_factory):
    """Two experts (top-2): with ep=2 on four ranks each expert is FSDP-sharded on its second dim."""
    torch.manual_seed(1)
    config = tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False, num_experts=2, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(config)
    return str(save_per_expert_checkpoint(model, tmp_path_factory.mktemp("ckpt2")))


def test_two_processes(checkpoint, tmp_path):
    """ep=2: SGD steps + clipping + AdamW equal one process; EP save equals the single-process save;
    DCP resume; activation checkpointing; a user's (2, 1) mesh; bf16 compute; from_config; capacity
    dispatch; the pipelined dispatcher (ep_overlap_chunks 2 and 3); unsharded without ep_size; tied
    embeddings; save_pretrained / push_to_hub called on every rank write and push from rank 0 only."""
    torch.manual_seed(2)
    config = tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False, tie_word_embeddings=True)
    tied = save_per_expert_checkpoint(transformers.Qwen3MoeForCausalLM(config), tmp_path / "tied")
    spawn(workers.two_process_suite, 2, checkpoint, str(tied), str(tmp_path))


def test_four_processes(checkpoint, two_experts_checkpoint, tmp_path):
    """ep=4 and ep=2 x dp_shard_mod_ep=2: training parity and save equality; Shard(1) experts; the
    pipelined dispatcher at ep=4 and at ep=2 x 2 (FSDP2-sharded experts called once per chunk)."""
    spawn(workers.four_process_suite, 4, checkpoint, two_experts_checkpoint, str(tmp_path))


def test_other_architectures(tmp_path):
    """DeepSeek-V3 (MLA, shared expert, group-limited sigmoid router), GPT-OSS (expert biases, clamped
    SwiGLU, attention sinks) and Nemotron-H (Mamba-2 and attention layers, ungated experts): one
    step at ep=2 equals one process, with the all-to-all dispatcher + FSDP2 and with the all-gather
    dispatcher + replicated parameters + vocab_parallel (no aux loss: it is rank-local under EP)."""
    from tests.conftest import seeded_reference
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    folders = []
    for name, model_cls, config, randomized in (
        ("deepseek_v3", transformers.DeepseekV3ForCausalLM, tiny_deepseek_v3_config, ("e_score_correction_bias",)),
        ("gpt_oss", transformers.GptOssForCausalLM, tiny_gpt_oss_config, ()),
        ("nemotron_h", transformers.NemotronHForCausalLM, tiny_nemotron_h_config, ("e_score_correction_bias",)),
    ):
        reference = seeded_reference(model_cls, config(vocab_size=64, output_router_logits=False), randomized_suffixes=randomized)
        reference.save_pretrained(tmp_path / name)
        folders.append((name, str(tmp_path / name)))
    spawn(workers.other_architectures, 2, folders)


def test_global_aux_loss(tmp_path):
    """With the aux loss on, global_aux_loss=True makes one step at ep=2 equal one process on the whole
    batch (loss and every gradient), for Qwen3-MoE and GPT-OSS and with either dispatcher; without it
    each rank's aux loss sees its own tokens (Transformers under DDP), and the loss differs."""
    from tests.conftest import seeded_reference
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config

    folders = []
    for name, model_cls, config in (("qwen3_moe", transformers.Qwen3MoeForCausalLM, tiny_qwen3_moe_config),
                                    ("gpt_oss", transformers.GptOssForCausalLM, tiny_gpt_oss_config)):  # fmt: skip
        reference = seeded_reference(model_cls, config(vocab_size=64, output_router_logits=True, router_aux_loss_coef=0.5))
        reference.save_pretrained(tmp_path / name)
        folders.append((name, str(tmp_path / name)))
    spawn(workers.global_aux_loss, 2, folders)


def test_vocab_parallel(checkpoint, tmp_path):
    """vocab_parallel=True (embedding and LM head split by vocabulary rows over the ranks) equals one process."""
    folders = []
    for name, overrides in (("tied", {"tie_word_embeddings": True}), ("vocab65", {"vocab_size": 65})):
        torch.manual_seed(3)
        config = tiny_qwen3_moe_config(**{"vocab_size": 64, "output_router_logits": False, **overrides})
        folders.append(str(save_per_expert_checkpoint(transformers.Qwen3MoeForCausalLM(config), tmp_path / name)))
    spawn(vocab_parallel_workers.vocab_parallel_suite, 2, checkpoint, *folders, str(tmp_path))


def test_allgather_dispatch_and_replicated_dense(checkpoint, tmp_path):
    """ep_dispatch='allgather' + dense_parallel='replicate' (CUDA-graph capturable EP) equals one process."""
    spawn(replicate_workers.allgather_and_replicate_suite, 2, checkpoint, str(tmp_path))


def test_trainer(checkpoint, tmp_path):
    """moetune.Trainer on expert-parallel models equals Transformers' Trainer + DDP; save; resume."""
    pytest.importorskip("accelerate")  # Trainer needs it
    spawn(workers.trainer_suite, 2, checkpoint, str(tmp_path))


def test_bad_inputs(checkpoint):
    spawn(workers.bad_inputs, 2, checkpoint)


def test_needs_a_process_group():
    with pytest.raises(ValueError, match="need torch.distributed"):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab_size=64), ep_size=2)


@pytest.mark.parametrize("ep_size", [0, -2, 2.0])
def test_ep_size_must_be_a_positive_int(ep_size):
    with pytest.raises(ValueError, match="ep_size must be a positive int"):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab_size=64), ep_size=ep_size)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"ep_overlap_chunks": 0}, "ep_overlap_chunks must be a positive int"),
        ({"ep_overlap_chunks": 2.0}, "ep_overlap_chunks must be a positive int"),
        ({"ep_overlap_chunks": True}, "ep_overlap_chunks must be a positive int"),
        ({"ep_overlap_chunks": 2, "ep_capacity_factor": 2.0}, "cannot be combined with ep_capacity_factor"),
        ({"ep_dispatch": "broadcast"}, "ep_dispatch must be one of"),
        ({"ep_dispatch": "allgather", "ep_capacity_factor": 2.0}, "takes neither ep_capacity_factor"),
        ({"dense_parallel": "ddp"}, "dense_parallel must be one of"),
        ({"dense_parallel": "replicate", "replicate_max_ctas": 0}, "replicate_max_ctas must be a positive int"),
        ({"vocab_parallel": True}, r"vocab_parallel=True splits the embedding and LM head of dense_parallel='replicate'"),
        ({"dense_parallel": "replicate", "vocab_parallel": "yes"}, "vocab_parallel must be True or False"),
    ],
)
def test_ep_overlap_chunks_is_checked(options, match):
    with pytest.raises(ValueError, match=match):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab_size=64), ep_size=2, **options)


def test_lora_through_from_pretrained_under_expert_parallelism(checkpoint):
    spawn(workers.lora_under_expert_parallelism, 2, checkpoint)


@pytest.mark.parametrize("widths", [(4, 2, 2), (3, 3, 1), (5, 1, 7)])
def test_dispatch_packs_tokens_weights_and_ids_into_one_row(widths):
    """The all-gather dispatcher sends a token's hidden row, routing weights and expert ids as one packed
    row of bytes; every part comes back bit for bit, whatever its width (odd widths are padded so each
    part's view stays aligned)."""
    from moetune.distributed.allgather_dispatcher import _as_bytes, _unpack

    hidden, top_k, tokens = widths
    parts = [torch.randn(tokens, hidden).bfloat16(), torch.rand(tokens, top_k), torch.randint(0, 128, (tokens, top_k))]
    packed = torch.cat([_as_bytes(part) for part in parts], 1)
    assert packed.shape[1] % 8 == 0
    for got, want in zip(_unpack(packed, parts), parts, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_bucketed_row_counts():
    """At most 1/8 padding, monotone, exact up to 8 rows and on bucket sizes; the row counts around a
    Qwen3-30B-A3B step's 32768 routed rows per rank (+-25%) fall into 7 buckets."""
    from moetune.distributed.dispatcher import bucketed_row_count

    assert [bucketed_row_count(rows) for rows in range(10)] == list(range(10))
    assert [bucketed_row_count(rows) for rows in (17, 32768, 32769, 36864, 36865)] == [18, 32768, 36864, 36864, 40960]
    buckets = [bucketed_row_count(rows) for rows in range(1, 70000)]
    assert all(rows <= b <= rows * 1.125 for rows, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert len({bucketed_row_count(rows) for rows in range(24576, 40961)}) == 7


def test_bucketing_is_an_explicit_choice():
    """The all-to-all dispatchers hand their experts the exact received rows unless asked to bucket
    them (quack's experts bucket their own tuning, ``quack_grouped_gemm.TunedConfigs``)."""
    from moetune.distributed import ExpertParallelDispatcher, PipelinedExpertParallelDispatcher

    group = object()  # not used before a step
    assert not ExpertParallelDispatcher(group=group, ep_size=2).bucket_rows
    assert not PipelinedExpertParallelDispatcher(group=group, ep_size=2, num_chunks=2).bucket_rows
    assert ExpertParallelDispatcher(group=group, ep_size=2, bucket_rows=True).bucket_rows


