"""FP8 under expert parallelism: two gloo processes on CPU through the reference backend."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import save_per_expert_checkpoint, tiny_qwen3_moe_config
from tests.distributed import fp8_workers
from tests.distributed.helpers import spawn

pytestmark = pytest.mark.distributed


def test_fp8_expert_parallel_equals_one_process(tmp_path):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(vocab_size=64, output_router_logits=False))
    spawn(fp8_workers.fp8_expert_parallel_parity, 2, str(save_per_expert_checkpoint(model, tmp_path / "ckpt")))
