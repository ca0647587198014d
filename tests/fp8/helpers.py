"""Inputs and models shared by the FP8 tests."""

from __future__ import annotations

import copy

import torch

import moetune
from moetune.fp8 import Fp8Settings
from moetune.models.fp8 import enable_fp8
from moetune.optim import AdamW
from tests.conftest import tiny_family_config, tiny_qwen3_moe_config

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h")


def family_config(family: str):
    return tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_family_config(family)


def wide_range(*shape: int, generator: torch.Generator, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Normal values times 2**u, u uniform in [-12, 12]: a dynamic range that e4m3 (18 binades) cannot
    hold under one scale, so the recipes' scales matter."""
    values = torch.randn(*shape, generator=generator) * torch.exp2(torch.randint(-12, 13, shape, generator=generator).float())
    return values.to(device=device, dtype=dtype)


def routed_rows(num_tokens: int, top_k: int, counts: list[int], *, generator: torch.Generator, device="cpu"):
    """(gather order N = T*K, group ends) for ``counts`` rows per expert (summing to T*K)."""
    assert sum(counts) == num_tokens * top_k
    order = torch.randperm(num_tokens * top_k, generator=generator).to(device)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    return order, offsets


def grouped_reference(x_T, w_EOK, order, offsets, top_k: int) -> torch.Tensor:
    """fp32 rows[order // top_k] @ w_e^T per group (the unquantised GEMM)."""
    rows = x_T.float()[torch.div(order, top_k, rounding_mode="floor")] if order is not None else x_T.float()
    ends = offsets.tolist()
    return torch.cat([rows[a:b] @ w_EOK[e].float().t() for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])


def train_losses(model, batches, *, lr: float = 1e-3) -> list[float]:
    optimizer = AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def bf16_and_fp8_models(family: str, settings: Fp8Settings, *, device="cpu", dtype=torch.bfloat16):
    """The same tiny model twice: as built, and switched to FP8."""
    torch.manual_seed(0)
    with torch.device(device):
        model = moetune.AutoModelForCausalLM.from_config(family_config(family), dtype=dtype).train()
    return model, enable_fp8(copy.deepcopy(model), settings)


def token_batches(vocab: int, n: int, *, device="cpu", shape=(2, 32)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, shape, generator=generator).to(device) for _ in range(n)]
