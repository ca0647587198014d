"""The correctness check that runs before any timing: moetune's bf16 loss, logits and gradients
must be as close to an fp32 reference as Transformers' bf16 ones are.

The reference is Transformers in fp32 (eager experts) holding exactly the bf16 weights (drawn in
fp32, rounded through bf16), so the errors measure computation, not weight rounding. moetune
passes a metric when its error is at most ``tolerance_ratio`` (2) x Transformers' error, or below
bf16's resolution (2^-8 relative), where the ratio of two rounding noises means nothing.

Shape legend: B micro-batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator
from typing import Any

import torch

from moetune.bench.env import RunEnv
from moetune.bench.models import BenchModel, build_hf, build_side
from moetune.bench.run import tokens

BF16_RESOLUTION = 2.0**-8
METRICS = ("loss", "logits", "grads")


def run_parity(
    config,
    *,
    env: RunEnv,
    seed: int,
    seq_len: int,
    micro_batch: int = 1,
    routing: str = "real",
    tolerance_ratio: float = 2.0,
    moetune_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    device = env.device
    balanced = routing == "balanced"
    input_ids_BS = tokens(
        vocab_size=config.vocab_size, micro_batch=micro_batch, seq_len=seq_len, seed=seed, rank=env.rank, device=device
    )
    with _full_fp32_matmuls():
        reference_model = build_hf(
            config, device=device, dtype=torch.float32, seed=seed, experts_implementation="eager",
            round_to=torch.bfloat16,
        )
        reference = _evaluate(reference_model, input_ids_BS, balanced=balanced)
    del reference_model
    _free(device)

    errors: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, Any]] = {}
    for side in ("hf", "moetune"):
        bench = build_side(
            side, config, device=device, dtype=torch.bfloat16, seed=seed, balanced_gate=balanced,
            options=moetune_options,
        )
        outputs[side] = _evaluate(bench, input_ids_BS, balanced=balanced)
        errors[side] = _errors(outputs[side], reference)
        errors[side]["built"] = bench.notes
        del bench
        _free(device)
    between = _errors(outputs["moetune"], outputs["hf"])
    del outputs, reference
    _free(device)

    checks = {}
    for metric in METRICS:
        hf_error, moetune_error = errors["hf"][metric], errors["moetune"][metric]
        passed = moetune_error <= tolerance_ratio * hf_error or moetune_error <= BF16_RESOLUTION
        checks[metric] = {
            "hf_error": hf_error,
            "moetune_error": moetune_error,
            "ratio": moetune_error / hf_error if hf_error > 0 else None,
            "passed": bool(passed),
        }
    return {
        "passed": all(c["passed"] for c in checks.values()),
        "checks": checks,
        "criterion": (
            f"moetune bf16 error <= {tolerance_ratio} x Transformers bf16 error (or <= 2^-8), vs fp32 reference"
        ),
        "errors": errors,
        "moetune_vs_hf": {k: between[k] for k in METRICS},
        "setup": {
            "layers": config.num_hidden_layers,
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            "routing": routing,
            "reference": "transformers fp32, eager experts, bf16-rounded weights",
        },
    }


def _evaluate(bench: BenchModel, input_ids_BS: torch.Tensor, *, balanced: bool) -> dict[str, Any]:
    """Loss and gradients of one training step's forward/backward, and the logits of a plain forward."""
    model = bench.model
    with bench.routing_context(balanced):
        model.zero_grad(set_to_none=True)
        loss = bench.loss(input_ids_BS)
        loss.backward()
        grads = {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            logits_BSV = model(input_ids=input_ids_BS, use_cache=False).logits.float()
    return {"loss": float(loss.detach().float()), "logits": logits_BSV, "grads": grads}


def _errors(output: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Relative errors: |loss - ref| / |ref|, ||logits - ref|| / ||ref||, and for the gradients the
    norm over all parameters together (a missing gradient counts as zeros), plus the worst one."""
    loss_error = abs(output["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-12)
    logits_error = float((output["logits"] - reference["logits"]).norm() / reference["logits"].norm().clamp_min(1e-30))
    diff_sq = ref_sq = 0.0
    worst_name, worst = None, 0.0
    for name, ref_grad in reference["grads"].items():
        grad = output["grads"].get(name)
        diff = ref_grad.norm() if grad is None else (grad - ref_grad).norm()
        diff_sq += float(diff) ** 2
        ref_norm = float(ref_grad.norm())
        ref_sq += ref_norm**2
        relative = float(diff) / ref_norm if ref_norm > 0 else 0.0
        if relative > worst:
            worst_name, worst = name, relative
    missing = sorted(set(reference["grads"]) ^ set(output["grads"]))
    return {
        "loss": loss_error,
        "logits": logits_error,
        "grads": math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30),
        "worst_grad": {"name": worst_name, "relative_error": worst},
        "grads_missing_or_extra": missing,
        "loss_value": output["loss"],
    }


@contextlib.contextmanager
def _full_fp32_matmuls() -> Iterator[None]:
    """No TF32 in the reference, whatever the process's setting (it would cost ~3 decimal digits)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
