"""Fixtures for the LoRA tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
