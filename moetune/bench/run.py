"""Training rows for one side: each row is a (routing, micro-batch, sequence, checkpointing) setting
timed on a model built once per side.

Shape legend: B micro-batch, S sequence length.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from moetune.bench.env import RunEnv, reduce_max
from moetune.bench.measure import GIB, make_optimizer, measure_steps, peak_memory_bytes, state_bytes
from moetune.bench.models import BenchModel
from moetune.distributed.grad_norm import clip_before_update

ROUTINGS = ("real", "balanced")


@dataclass(frozen=True)
class Row:
    routing: str
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool = False

    @property
    def label(self) -> str:
        ac = " AC" if self.activation_checkpointing else ""
        return f"mb{self.micro_batch} s{self.seq_len} {self.routing}{ac}"


def make_rows(
    *, routings: list[str], micro_batches: list[int], seq_len: int, activation_checkpointing: list[bool]
) -> list[Row]:
    for routing in routings:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if any(mb < 1 for mb in micro_batches) or seq_len < 2:
        raise ValueError(f"need micro-batch >= 1 and seq-len >= 2, got {micro_batches} and {seq_len}")
    return [
        Row(routing, mb, seq_len, ac)
        for mb, ac, routing in itertools.product(micro_batches, activation_checkpointing, routings)
    ]


@dataclass
class RowResult:
    side: str
    row: Row
    step_s: float | None = None
    fwd_bwd_s: float | None = None
    optimizer_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    state_gib: float | None = None
    working_gib: float | None = None
    losses: list[float] = field(default_factory=list)
    all_step_s: list[float] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("row")
        return {"label": self.row.label, **asdict(self.row), **data}


def tokens(
    *, vocab_size: int, micro_batch: int, seq_len: int, seed: int, rank: int, device: torch.device
) -> torch.Tensor:
    """Random token ids, the same for both sides (each rank its own micro-batch)."""
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    return torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator, device=device)


def is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text


def run_rows(
    bench: BenchModel,
    rows: list[Row],
    *,
    env: RunEnv,
    flops_per_token: dict[int, float],
    peak_tflops: float | None,
    warmup: int,
    steps: int,
    seed: int,
    lr: float,
    on_result: Callable[[RowResult], None] | None = None,
    moetune_optimizer: str = "torch",
    moetune_cuda_graph: bool = False,
    moetune_overlap_optimizer: bool = False,
    max_grad_norm: float | None = None,
    autocast: bool = False,
) -> list[RowResult]:
    """Time every row on one built model with one optimizer (its states persist across rows, as in
    a real run; both sides run the same rows in the same order, so they see the same history).
    ``on_result`` sees each row as soon as it is measured. ``moetune_cuda_graph``: moetune's steps
    replay CUDA graphs (``moetune.training.CUDAGraphTrainStep``), with each parameter's update run
    during the backward if ``moetune_overlap_optimizer``. ``max_grad_norm``: the gradients are clipped
    before each update, in the optimizer's phase (as Trainer's ``max_grad_norm``); ``autocast``: the
    forwards run under ``torch.autocast`` to bf16 (as Trainer's ``bf16=True``)."""
    is_moetune = bench.side == "moetune"
    kind = moetune_optimizer if is_moetune else "torch"  # Transformers keeps torch's fused AdamW
    cuda_graph = moetune_cuda_graph and is_moetune
    optimizer = make_optimizer(bench.model, lr=lr, device=env.device, kind=kind, capturable=cuda_graph)
    results = []
    for row in rows:
        result = RowResult(bench.side, row)
        try:
            _run_row(bench, optimizer, row, result, env=env, warmup=warmup, steps=steps, seed=seed, cuda_graph=cuda_graph,
                     overlap_optimizer=moetune_overlap_optimizer and is_moetune, max_grad_norm=max_grad_norm,
                     autocast=autocast)  # fmt: skip
        except Exception as error:  # noqa: BLE001 -- one failing row must not lose the others
            if env.distributed:  # a failure on one rank leaves the others waiting in a collective
                raise
            result.error = "OOM" if is_oom(error) else f"{type(error).__name__}: {error}"
        else:
            _fill_rates(result, flops_per_token[row.seq_len], peak_tflops, row, env)
        if result.error:  # here, not in the except block: its traceback still holds the activations
            optimizer.zero_grad(set_to_none=True)
            _free(env.device)
        bench.set_activation_checkpointing(False)
        results.append(result)
        if on_result is not None:
            on_result(result)
    del optimizer
    _free(env.device)
    return results


def _run_row(
    bench: BenchModel, optimizer, row: Row, result: RowResult, *, env: RunEnv, warmup: int, steps: int, seed: int,
    cuda_graph: bool = False,
    overlap_optimizer: bool = False,
    max_grad_norm: float | None = None,
    autocast: bool = False,
) -> None:
    input_ids_BS = tokens(
        vocab_size=bench.config.vocab_size, micro_batch=row.micro_batch, seq_len=row.seq_len,
        seed=seed, rank=env.rank, device=env.device,
    )
    bench.set_activation_checkpointing(row.activation_checkpointing)

    def loss_of(input_ids: torch.Tensor) -> torch.Tensor:
        if not autocast:
            return bench.loss(input_ids)
        with torch.autocast(env.device.type, dtype=torch.bfloat16):
            return bench.loss(input_ids)

    def forward_backward() -> torch.Tensor:
        loss = loss_of(input_ids_BS)
        loss.backward()
        return loss

    def optimizer_step() -> None:
        if max_grad_norm is not None:
            clip_before_update(list(bench.model.parameters()), max_grad_norm, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    graphed = None
    if cuda_graph:  # the first warm-up step is eager, the second captures; the measured steps replay
        from moetune.training import CUDAGraphTrainStep

        if warmup < 2:
            raise ValueError(f"the CUDA-graph side needs at least 2 warm-up steps (eager, capture), got {warmup}")
        graphed = CUDAGraphTrainStep(
            bench.model, optimizer, warmup_steps=1, loss_fn=lambda _, b: loss_of(b["input_ids"]),
            overlap_optimizer=overlap_optimizer, max_grad_norm=max_grad_norm,
        )

        def forward_backward() -> torch.Tensor:
            return graphed.forward_backward(input_ids=input_ids_BS)

        optimizer_step = graphed.optimizer_step

    with bench.routing_context(row.routing == "balanced"):
        try:
            times = measure_steps(
                forward_backward, optimizer_step, device=env.device, warmup=warmup, steps=steps,
                peak_from_warmup_step=1 if graphed is not None else None,  # the capture step
            )
        finally:
            if graphed is not None:  # release the graphs' memory pool before the next row
                graphed.close()
                del graphed, forward_backward, optimizer_step
                optimizer.zero_grad(set_to_none=True)
    result.step_s = reduce_max(times.step_s, env)
    result.fwd_bwd_s = reduce_max(times.fwd_bwd_s, env)
    result.optimizer_s = reduce_max(times.optimizer_s, env)
    result.all_step_s = times.all_step_s
    result.losses = times.losses
    state = state_bytes(bench.model, optimizer)
    result.state_gib = reduce_max(state["total"] / GIB, env)
    peaks = peak_memory_bytes(env.device)
    if peaks is not None:
        result.peak_gib = reduce_max(peaks[0] / GIB, env)
        result.reserved_gib = reduce_max(peaks[1] / GIB, env)
        result.working_gib = reduce_max((peaks[0] - state["total"]) / GIB, env)


def _fill_rates(result: RowResult, flops_per_token: float, peak_tflops: float | None, row: Row, env: RunEnv) -> None:
    result.tokens_per_s_per_gpu = row.micro_batch * row.seq_len / result.step_s
    result.tflops_per_gpu = result.tokens_per_s_per_gpu * flops_per_token / 1e12
    if peak_tflops:
        result.mfu = result.tflops_per_gpu / peak_tflops


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        # cuBLAS keeps a workspace per stream it ran on, in the caching allocator: a graphed row's capture
        # stream leaves one behind that would count in the next row's peak.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
