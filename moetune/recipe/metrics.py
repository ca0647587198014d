"""Training metrics: FLOPs and MFU (``moetune.flops``), expert load, and the sinks (progress bar, JSONL,
TensorBoard, Weights & Biases).

Letters: T = tokens, E = experts, L = MoE layers.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from moetune.recipe.config import MetricsConfig


def num_routed_experts(model_config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (0 for a dense model), under each family's name: Qwen3-MoE's
    ``num_experts``, Mixtral's and GPT-OSS's ``num_local_experts``, DeepSeek-V3's and Nemotron-H's
    ``n_routed_experts`` (which older Transformers versions do not alias to ``num_local_experts``)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(model_config, name, None)
        if value:
            return int(value)
    return 0


def moe_layer_ids(model_config: PretrainedConfig) -> list[int]:
    """Indices of the decoder layers with experts: Nemotron-H's ``layers_block_type`` "moe" blocks,
    DeepSeek-V3's layers from ``first_k_dense_replace`` on, else Qwen3-MoE's rule (not in
    mlp_only_layers, every decoder_sparse_step-th layer; every layer for GPT-OSS / Mixtral)."""
    if not num_routed_experts(model_config):
        return []
    block_types = getattr(model_config, "layers_block_type", None)
    if block_types:
        return [i for i, kind in enumerate(block_types) if kind == "moe"]
    first_dense = getattr(model_config, "first_k_dense_replace", None)
    if first_dense is not None:
        return list(range(first_dense, model_config.num_hidden_layers))
    dense = set(getattr(model_config, "mlp_only_layers", None) or [])
    step = getattr(model_config, "decoder_sparse_step", 1) or 1
    return [i for i in range(model_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, accumulated on the device (no host sync
    per step)."""

    def __init__(self, *, num_layers: int, num_experts: int, top_k: int, device: torch.device) -> None:
        self.top_k, self.num_experts = top_k, num_experts
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)
        self._chosen: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[None]:
        """Record the experts moetune's routers actually choose during the forward in the block (a
        router's choice may add a bias and limit groups, which the logits alone do not show); ``add``
        then counts those instead of the logits' top-k. Hooks are removed on exit, so activation
        checkpointing's recomputation is not counted twice."""
        from moetune.moe import ROUTERS

        handles = [
            module.register_forward_hook(lambda _m, _i, routing: self._chosen.append(routing.experts_TK))
            for module in model.modules() if isinstance(module, ROUTERS)
        ]  # fmt: skip
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def add(self, router_logits: tuple[torch.Tensor, ...] | None, real_T: torch.Tensor) -> None:
        """Count each MoE layer's routed experts of the real tokens (``real_T``: False for padding):
        the choices ``recording`` saw, else the top-k of ``router_logits`` (per layer [T, E], the
        routing of softmax routers such as Transformers' fallback models')."""
        chosen_per_layer = self._chosen or [logits_TE.topk(self.top_k, dim=-1).indices for logits_TE in router_logits or ()]
        self._chosen = []
        # Once, without blocking: a blocking copy of the host's mask per layer made the eager recipe's
        # host wait for the whole forward before queueing the backward (profiled on an H200, 2026-12-01).
        real_T = real_T.to(self.counts_LE.device, non_blocking=True)
        for layer, experts_TK in enumerate(chosen_per_layer):
            # Weighted adds, not a masked selection + bincount: no data-dependent shape, so no host
            # synchronisation, and the count can run inside a CUDA-graph step.
            real_TK = real_T.unsqueeze(-1).expand_as(experts_TK)
            self.counts_LE[layer].index_add_(0, experts_TK.flatten().long(), real_TK.flatten().long())

    def as_lists(self) -> list[list[int]]:
        return self.counts_LE.tolist()


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the peak resident set size of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def start_metrics_file(path: Path, *, resumed_step: int) -> None:
    """Make ``path`` hold one run's history before the run appends to it. A fresh run
    (``resumed_step`` 0) starts it anew, an earlier run's file kept beside it as
    ``metrics.<its last write time>.jsonl``; a resumed run keeps the records up to its step and
    drops those after it (steps it is about to redo, or a crash's half-written line)."""
    if not path.exists():
        return
    if resumed_step == 0:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(path.stat().st_mtime))
        kept, n = path.with_name(f"metrics.{stamp}.jsonl"), 1
        while kept.exists():
            kept, n = path.with_name(f"metrics.{stamp}-{n}.jsonl"), n + 1
        os.replace(path, kept)
        return
    lines = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= resumed_step:
            lines.append(line)
    tmp = path.with_name(f".{path.name}.tmp")  # replaced in one step: a crash here loses nothing
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


class MetricsSink:
    """Writes one record per log step to every enabled sink. Only rank 0 builds one."""

    def __init__(self, config: MetricsConfig, *, output_dir: Path, total_steps: int, initial_step: int,
                 run_config: dict[str, Any]) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        start_metrics_file(output_dir / "metrics.jsonl", resumed_step=initial_step)
        self.jsonl = (output_dir / "metrics.jsonl").open("a")
        self.bar = None
        if config.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="finetune", dynamic_ncols=True)
        self.tensorboard = None
        if config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                print("metrics.tensorboard: tensorboard is not installed; skipping it", file=sys.stderr)
        self.wandb = None
        if config.wandb_project:
            try:
                import wandb

                self.wandb = wandb.init(project=config.wandb_project, config=run_config, dir=str(output_dir))
            except ImportError:
                print("metrics.wandb_project: wandb is not installed; skipping it", file=sys.stderr)

    def log(self, record: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        step = record.get("step", 0)
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def advance(self, steps: int, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            self.bar.set_postfix(postfix, refresh=False)

    def message(self, text: str) -> None:
        """A line for the user, printed above the progress bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class NullSink:
    """The sink of ranks other than 0: accepts everything, writes nothing."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def advance(self, steps: int, postfix: dict[str, str]) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def format_postfix(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's short fields."""
    out = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "gnorm": f"{record['grad_norm']:.2f}",
           "tok/s/gpu": f"{record['tokens_per_s_per_gpu']:.0f}", "TFLOP/s": f"{record['tflops_per_gpu']:.2f}"}
    out["mfu"] = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"
    out["mem"] = f"{record['peak_mem_gib']:.1f}G"
    return out
