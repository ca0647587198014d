"""Where a benchmark runs: device, process group, library versions, commit, GPU name."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from moetune.utils.process import ProcessInfo

REPO_ROOT = Path(__file__).resolve().parents[2]


# The benchmark's view of the process: rank, world size and device (no extra fields).
RunEnv = ProcessInfo


def setup(device: str | None = None) -> RunEnv:
    """One process, or one rank of a torchrun launch (WORLD_SIZE > 1: NCCL on GPU, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    wants_cuda = device != "cpu" and torch.cuda.is_available()
    if world_size > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        chosen = torch.device("cuda", local_rank) if wants_cuda else torch.device("cpu")
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if chosen.type == "cuda" else "gloo")
        return RunEnv(chosen, dist.get_rank(), dist.get_world_size())
    if device is not None and device not in ("auto", "cuda", "cpu") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device in (None, "auto"):
        chosen = torch.device("cuda", 0) if wants_cuda else torch.device("cpu")
    else:
        chosen = torch.device(device)
        if chosen.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device} but CUDA is not available")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return RunEnv(chosen, 0, 1)


def teardown(env: RunEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def reduce_max(value: float | None, env: RunEnv) -> float | None:
    """Max over ranks (the slowest rank sets the step time, the fullest one the memory)."""
    if not env.distributed or value is None:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def versions() -> dict[str, str | None]:
    import transformers

    import moetune

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "moetune": moetune.__version__,
    }


def commit() -> dict[str, str | bool | None]:
    """$MOETUNE_COMMIT where set (a copied tree's ``.git`` can be stale: the caller names the commit it
    sent), else ``git rev-parse HEAD`` and whether the tree has local changes."""
    value = os.environ.get("MOETUNE_COMMIT")
    if value:
        return {"commit": value, "dirty": None, "source": "MOETUNE_COMMIT"}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return {"commit": head, "dirty": bool(status.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "source": None}


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def hardware_slug(device: torch.device, world_size: int) -> str:
    """Short hardware name for result files: ``h200``, ``2xh200``, ``cpu``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        match = re.search(r"\b([a-z]+\d{2,4}[a-z]*)\b", name.replace("nvidia", ""))
        slug = match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    else:
        slug = "cpu"
    return f"{world_size}x{slug}" if world_size > 1 else slug


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
