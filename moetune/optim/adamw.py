"""AdamW with one fused Triton kernel per parameter tensor (CUDA), else ``torch.optim.AdamW``.

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments, eps added
after the square root), computed in fp32 with the moments stored in the parameter's dtype — what
torch's ``fused=True`` does for bf16 parameters. The step is memory-bound (per element: read
parameter, gradient and two moments, write three), so the kernel's job is to stream those 14
bytes per bf16 element at full bandwidth; one launch per tensor with large blocks does that better
than the multi-tensor-apply chunking of torch's fused kernel on 100-500 MB expert tensors.

Bias corrections are computed on the host from a Python step counter (no device sync). With
``capturable=True`` the step counters and the learning rate live on the device instead and the
kernel reads them, so the step can be captured in a CUDA graph and replayed (see
``moetune.training.CUDAGraphTrainStep``); the learning rate is then a 0-d tensor that schedulers
update in place (``group["lr"].fill_(lr)``, which torch's LR schedulers do for tensor rates).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from moetune.kernels._triton_utils import HAS_TRITON, device_of, tl, triton

# Small blocks, many programs: 4.25 TB/s on an H200 (its copy ceiling) against 4.11 for 4096 / 8
# warps (benchmarks/probes/adamw_probe.py).
_BLOCK = 1024
_NUM_WARPS = 4

if HAS_TRITON:

    @triton.jit
    def _adamw_kernel(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, num_elements,
        lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
        lr_ptr, step_ptr, log2_beta1, log2_beta2, grad_scale_ptr,
        BLOCK: tl.constexpr, LR_ON_DEVICE: tl.constexpr, STEP_ON_DEVICE: tl.constexpr, SCALE_GRAD: tl.constexpr,
    ):  # fmt: skip
        if LR_ON_DEVICE:
            lr = tl.load(lr_ptr).to(tl.float32)
        if STEP_ON_DEVICE:  # beta**step as exp2(step * log2(beta)): fp32, like torch's capturable AdamW
            step = tl.load(step_ptr).to(tl.float32)
            bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
            bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if SCALE_GRAD:  # a non-finite coefficient (the gradients' norm was not finite): no update
            grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
            num_elements = tl.where(tl.abs(grad_scale) < float("inf"), num_elements, 0)
        mask = offsets < num_elements
        param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        if SCALE_GRAD:  # gradient clipping's coefficient, applied as the gradient is read
            grad = grad * grad_scale
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        param = param * (1.0 - lr * weight_decay)
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - (lr / bias_correction1) * exp_avg / denom
        tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


class AdamW(torch.optim.Optimizer):
    """Drop-in ``torch.optim.AdamW`` (same arguments and state keys ``step``, ``exp_avg``,
    ``exp_avg_sq``; state dicts load in either class) whose CUDA step is one Triton launch per
    parameter tensor. ``foreach`` / ``fused`` are accepted and ignored; ``amsgrad``, ``maximize``
    and ``differentiable`` are not implemented and raise a ValueError when set (also in a parameter
    group or a loaded state dict).

    Parameters that are not contiguous CUDA tensors, or any parameter when Triton is missing,
    take ``torch.optim.AdamW``'s functional step, so results agree everywhere.

    ``capturable=True`` (CUDA parameters and Triton only) keeps each ``step`` and every group's
    ``lr`` as device tensors read by the kernel: no host value is baked into the launches, so the
    step can be captured in a CUDA graph.

    ``set_gradient_scale(coefficient)`` makes the steps read every gradient multiplied by it:
    gradient clipping (``moetune.distributed.clip_grad_norm_(..., optimizer=)``) without its own pass over the gradients.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if float(lr) < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        # torch.optim.AdamW's arguments, so code written for it runs unchanged: foreach / fused pick
        # torch's kernels and are ignored (the CUDA step is this class's own fused kernel); the
        # update variants this class does not implement are refused, never silently dropped.
        _check_supported({"amsgrad": amsgrad, "maximize": maximize, "differentiable": differentiable}, "AdamW(...)")
        del foreach, fused
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)
        self._grad_scales: dict[torch.device, torch.Tensor] = {}  # set_gradient_scale's buffers
        self._grad_scale_on = False
        super().__init__(params, defaults)  # each group through add_param_group

    def add_param_group(self, param_group: dict) -> None:
        """torch's, refusing torch options this class does not implement (``amsgrad``, ``maximize``);
        a capturable group's parameters are checked and its rate becomes a device tensor."""
        _check_supported(param_group, "a parameter group")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["capturable"] and group["params"]:
            _require_capturable(group["params"])
            device = group["params"][0].device
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)

    def set_gradient_scale(self, scale: torch.Tensor | float | None) -> None:
        """Every later ``step()`` / ``step_parameter()`` reads each gradient multiplied by ``scale``
        (a 0-d tensor, e.g. a clipping coefficient still on the device, or a number), until
        ``set_gradient_scale(None)``. The kernel applies it as it reads the gradient, which saves
        the clipping's own read and write of every gradient (7.5 of a Qwen3-30B-A3B 8-layer step's
        ~84 ms on an H200). A non-finite ``scale`` (NaN: the norm was not finite) leaves parameters
        and moments as they are (the step count still advances), as a gradient scaler skips a step
        with infinities: a bad batch
        cannot reach the weights even where no host checks the norm first (a step replayed from a
        CUDA graph). The value is copied into a buffer this optimizer keeps per device, so a
        step captured in a CUDA graph reads each new value. Where the update falls back to torch's
        functional AdamW the gradient itself is scaled in place first, as clipping would."""
        if scale is None:
            self._grad_scale_on = False
            return
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32)
        if scale.numel() != 1:
            raise ValueError(f"set_gradient_scale takes one number (a 0-d tensor), got a tensor of shape {tuple(scale.shape)}")
        scale = scale.reshape(())
        buffers = self._grad_scales
        for device in {_local(p).device for group in self.param_groups for p in group["params"]}:
            if device not in buffers:
                buffers[device] = torch.ones((), dtype=torch.float32, device=device)
            buffers[device].copy_(scale, non_blocking=True)
        self._grad_scale_on = True

    def _grad_scale(self, device: torch.device) -> torch.Tensor | None:
        return self._grad_scales[device] if self._grad_scale_on else None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then each capturable group's rate back to a float32 tensor on its
        parameters' device (a checkpoint may hold it as a number or a CPU tensor). A state dict of
        torch's AdamW loads too, unless its groups use an option this class does not implement
        (``amsgrad``, ``maximize``; torch's Adam with L2 weight decay): refused, not ignored."""
        for group in state_dict["param_groups"]:
            _check_supported(group, "load_state_dict")
        super().load_state_dict(state_dict)
        self._groups_by_param = None  # torch replaced the group dicts
        for group in self.param_groups:
            if group.get("capturable") and group["params"]:
                device = group["params"][0].device
                group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            for param in params:
                if param.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients (torch.optim.SparseAdam does)")
                self._init_state(param, group)
            if group["capturable"] and params:
                torch._foreach_add_([self.state[param]["step"] for param in params], 1.0)
            for param in params:
                self._step_param(param, group)
        return loss

    @torch.no_grad()
    def step_parameter(self, param: torch.Tensor) -> None:
        """Update one parameter from its gradient now (optimizer-in-backward schedules)."""
        group = self._group_of(param)
        self._init_state(param, group)
        if group["capturable"]:
            self.state[param]["step"].add_(1.0)
        self._step_param(param, group)

    def _group_of(self, param: torch.Tensor) -> dict:
        groups = getattr(self, "_groups_by_param", None)
        if groups is None or param not in groups:  # built lazily; rebuilt after add_param_group
            groups = self._groups_by_param = {p: g for g in self.param_groups for p in g["params"]}
        return groups[param]

    def _init_state(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            step_device = param.device if group["capturable"] else "cpu"
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    @torch.no_grad()
    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[param]
        self._init_state(param, group)  # AdamWInBackward steps one parameter at a time
        local = _local(param)
        grad_scale = self._grad_scale(local.device)
        if group["capturable"]:  # step already incremented on the device (``step``)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device != local.device:
                # torch.distributed.checkpoint primes an empty optimizer with one step at a CPU
                # zero rate before loading into it (resume); the kernel reads device memory only.
                lr = lr.to(local.device)
            _triton_step(local, _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                         lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], step=state["step"], grad_scale=grad_scale)  # fmt: skip
        elif HAS_TRITON and local.is_cuda and local.is_contiguous() and _local(param.grad).is_contiguous():
            state["step"] += 1
            step = int(state["step"].item())  # a host tensor: no device sync
            _triton_step(local, _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                         lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale)  # fmt: skip
        else:  # increments state["step"] itself
            if grad_scale is not None:
                if not bool(torch.isfinite(grad_scale)):  # as the kernel: no update (a host read, off the fast path)
                    return
                _local(param.grad).mul_(grad_scale)
            torch.optim._functional.adamw(
                [param], [param.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                amsgrad=False, beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )  # fmt: skip


# torch.optim.AdamW group options with no equivalent here, and the value this class implements.
_IMPLEMENTED = {"amsgrad": False, "maximize": False, "differentiable": False, "decoupled_weight_decay": True}


def _check_supported(options: dict, where: str) -> None:
    for name, implemented in _IMPLEMENTED.items():
        if name in options and bool(options[name]) != implemented:
            raise ValueError(
                f"moetune.optim.AdamW does not implement {name}={options[name]!r} ({where}); "
                "use torch.optim.AdamW (or torch.optim.Adam) for it"
            )


def _require_capturable(params: list[torch.Tensor]) -> None:
    for param in params:
        local = _local(param)
        if not (HAS_TRITON and local.is_cuda and local.is_contiguous()):
            raise ValueError(
                "AdamW(capturable=True) needs Triton and contiguous CUDA parameters; got a "
                f"{tuple(local.shape)} {local.device} parameter (contiguous={local.is_contiguous()}, triton={HAS_TRITON})"
            )


class AdamWInBackward(AdamW):
    """AdamW that updates each parameter during ``loss.backward()``, as soon as its gradient is
    complete, on a side CUDA stream, and frees the gradient right away.

    The update (memory-bound) overlaps the rest of the backward (compute-bound GEMMs), and no
    full set of gradients ever exists (one parameter's worth at a time). ``step()`` only makes
    the next forward wait for the updates; ``zero_grad()`` has nothing to clear.

    The price: one backward per step (no gradient accumulation) and no gradient clipping (the
    global norm is unknown when the first parameter is updated). Single device only.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        for param in (p for group in self.param_groups for p in group["params"]):
            if hasattr(param, "to_local"):
                raise ValueError("AdamWInBackward supports unsharded parameters only (use AdamW with FSDP2 / EP)")
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def set_gradient_scale(self, scale: torch.Tensor | float | None) -> None:
        if scale is not None:
            raise ValueError("AdamWInBackward updates each parameter before the gradients' joint norm is known: "
                             "no gradient clipping (use AdamW)")

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        if self._stream is None or not grad.is_cuda:
            self.step_parameter(param)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._stream):
                self.step_parameter(param)
            grad.record_stream(self._stream)  # the allocator must not reuse it before the update ran
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = _run_closure(closure)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed as soon as they are used."""


def _run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _triton_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                 grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW update of one tensor. ``lr`` and ``step`` are Python numbers (bias corrections on
    the host) or 0-d fp32 device tensors (read by the kernel, for CUDA-graph capture);
    ``grad_scale``: a 0-d fp32 device tensor the gradient is multiplied by as it is read."""
    num_elements = param.numel()
    if num_elements == 0:
        return
    lr_on_device, step_on_device = isinstance(lr, torch.Tensor), isinstance(step, torch.Tensor)
    host_lr = 0.0 if lr_on_device else lr
    bias_correction1 = 1.0 if step_on_device else 1.0 - beta1**step
    bias_correction2_sqrt = 1.0 if step_on_device else math.sqrt(1.0 - beta2**step)
    with device_of(param):
        _adamw_kernel[(triton.cdiv(num_elements, _BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, num_elements,
            host_lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
            lr if lr_on_device else param, step if step_on_device else param, _log2(beta1), _log2(beta2),
            grad_scale if grad_scale is not None else param,
            BLOCK=_BLOCK, LR_ON_DEVICE=lr_on_device, STEP_ON_DEVICE=step_on_device, SCALE_GRAD=grad_scale is not None,
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf
