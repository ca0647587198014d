"""Which process of a (torchrun) launch this is, and on which device it computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProcessInfo:
    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1
