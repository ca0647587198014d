"""The largest token count of a process group, for collectives that need one shape on every rank
(the all-gather dispatcher's tokens, the capacity dispatcher's blocks, the replicated embedding's
gradient rows).

Eager calls exchange the counts (one host sync) so a shorter rank can pad itself. Calls being
captured in a CUDA graph or traced by torch.compile cannot read a device value on the host: they take this rank's own count,
which is right when the eager warm-up found the counts equal (packed, fixed-shape micro-batches);
after an eager call with unequal counts a capture raises, instead of issuing collectives of
mismatched sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _capturing() -> bool:
    """Inside a CUDA-graph capture or a torch.compile trace: no device value can reach the host."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def collective_device(group) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live (NCCL: this rank's GPU)."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


class LargestTokenCount:
    """``counts(num_tokens)``: the largest token count of ``group``; ``uneven``: whether the last
    eager call saw different counts on the ranks. ``what`` names the caller in the capture error."""

    def __init__(self, group: dist.ProcessGroup, *, what: str) -> None:
        self.group = group
        self.what = what
        self.uneven = False

    def __call__(self, num_tokens: int) -> int:
        if _capturing():
            if self.uneven:
                raise ValueError(
                    f"{self.what} is being captured in a CUDA graph with different token counts on the ranks: "
                    "pack or pad every micro-batch to one shape"
                )
            return num_tokens
        mine = torch.tensor([num_tokens], dtype=torch.int64, device=collective_device(self.group))
        gathered = mine.new_empty(dist.get_world_size(self.group))
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        counts = gathered.tolist()  # the host sync (eager calls only)
        self.uneven = len(set(counts)) > 1
        return max(counts)
