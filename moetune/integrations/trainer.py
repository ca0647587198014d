"""``moetune.Trainer`` (and ``moetune.SFTTrainer``): Transformers' ``Trainer`` (TRL's
``SFTTrainer``) with moetune's optimizer on one GPU, that also trains moetune's expert-parallel models.

    # from transformers import Trainer
    from moetune import Trainer            # or: from moetune import SFTTrainer (TRL)

On one CUDA device, for a model that holds a moetune decoder stack (also inside PEFT's wrapper):

- torch's AdamW (Transformers' default ``adamw_torch_fused``, or ``adamw_torch``) becomes
  ``moetune.optim.AdamW`` with the same groups and hyper-parameters: the same update, one Triton
  kernel per tensor, about twice the bandwidth of torch's fused kernel on large expert tensors
  (37.5 vs 19.3 ms for Qwen3-30B-A3B's 8-layer 5.6 B bf16 parameters on an H200,
  benchmarks/README.md). A step whose gradient norm is not finite leaves the weights unchanged
  (torch's would write NaNs into them);
- gradient clipping (``max_grad_norm``) measures the norm with moetune's one-pass kernel and hands the
  clipping coefficient to that AdamW, which applies it as it reads each gradient, instead of a
  pass that reads and writes every gradient;
- forward and backward replay CUDA graphs, as with the model import alone
  (``moetune.training.graphed_backbone``);
- batches are copied to the GPU without blocking the host (accelerate's ``non_blocking``, with
  ``dataloader_pin_memory``, the default), so the host queues the next step while the GPU runs this one.
Any other model, optimizer or device: Transformers' ``Trainer`` unchanged.

A model loaded with ``ep_size`` / ``device_mesh`` under torchrun shards itself (expert parallelism plus
FSDP2 or replicated parameters) and reduces its own gradients, which Transformers' ``Trainer`` does
not know: accelerate would wrap it in DDP (and fail on its DTensor parameters), clip its gradients
with torch's clipping (wrong across meshes on older accelerate), save the model from the main
process only (a deadlock: every rank takes part in gathering the experts) and pickle the main
process's optimizer shards only. Here, for such a model:

- no DDP / FSDP wrapping by accelerate (``prepare_model(..., evaluation_mode=True)``);
- clipping through ``moetune.distributed.clip_grad_norm_``;
- torch's AdamW becomes ``moetune.optim.AdamW`` (as above; torch's multi-tensor kernels cannot step
  replicated tensors and DTensors together (``dense_parallel="replicate"``) nor are they known to take
  DTensors on different meshes);
- ``save_model`` gathers on every rank and the main process writes a plain Hugging Face checkpoint;
- checkpoints for resuming hold the model and optimizer shards as a torch.distributed.checkpoint
  folder (``moetune_dcp/``, written and read by every rank) next to that Hugging Face copy; the
  scheduler, RNG and trainer state are Transformers' own files.

Not supported with an expert-parallel model: ``load_best_model_at_end`` (refused at construction).
"""

from __future__ import annotations

import functools
import os

import torch
import transformers

from moetune.distributed.mesh import is_sharded_by_moetune

DCP_FOLDER = "moetune_dcp"


class MoetuneTrainerMixin:
    """What ``moetune.Trainer`` adds to Transformers' ``Trainer`` (and to subclasses such as TRL's
    ``SFTTrainer``); see the module. Put it first among the bases."""

    def __init__(self, model=None, *args, **kwargs) -> None:
        super().__init__(model, *args, **kwargs)
        self._moetune_parallel = is_sharded_by_moetune(self.model)
        self._moetune_optimizer = None  # moetune's AdamW when it replaced torch's (clipping goes through it)
        accelerator = self.accelerator
        clip_with_torch = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            from moetune.distributed import clip_grad_norm_ as clip

            if self._moetune_parallel:  # across both sets of shards
                accelerator.unscale_gradients()
                return clip(list(parameters), max_norm, norm_type=norm_type)
            if self._moetune_optimizer is None or norm_type != 2:
                return clip_with_torch(parameters, max_norm, norm_type=norm_type)
            accelerator.unscale_gradients()
            # The norm in one pass; moetune's AdamW applies the coefficient as it reads the gradients.
            return clip(list(parameters), max_norm, optimizer=self._moetune_optimizer)

        accelerator.clip_grad_norm_ = clip_grad_norm_
        if self.args.dataloader_pin_memory and (self._moetune_parallel or _on_one_cuda_device_with_moetune(self.model)):
            # Batches come from pinned memory: copied to the GPU without blocking the host, which then
            # queues the next step's replays while the GPU still runs this step's optimizer. A blocking
            # copy (accelerate's default) waits for the GPU to finish, leaving it idle while the host
            # prepares the next step (3-4 ms of an 88 ms Qwen3-30B-A3B 8-layer step on an H100).
            accelerator.dataloader_config.non_blocking = True
        if not self._moetune_parallel:
            return
        if self.args.load_best_model_at_end:
            raise ValueError(
                "moetune.Trainer: load_best_model_at_end is not supported with an expert-parallel model; "
                "keep the checkpoints and reload the best one with from_pretrained(..., ep_size=...)"
            )
        prepare_model, ours = accelerator.prepare_model, self.model

        def prepare_without_wrapping(model, device_placement=None, evaluation_mode=False):
            # The model reduces its own gradients (FSDP2 / replicated sync): no DDP on top.
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode or model is ours)

        accelerator.prepare_model = prepare_without_wrapping

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        optimizer_cls = type(_unwrap(optimizer))
        if self._moetune_parallel and optimizer_cls.__module__.startswith("transformers."):
            # Otherwise an opaque "mixed torch.Tensor and DTensor" error in the first step.
            option = getattr(self.args.optim, "value", self.args.optim)
            raise ValueError(
                f"TrainingArguments.optim={option!r}: Transformers' {optimizer_cls.__name__} updates plain tensors, "
                "not the DTensor shards of an expert-parallel model (ep_size); use optim='adamw_torch' (moetune's "
                "AdamW) or 'sgd'"
            )
        if (self._moetune_parallel or _on_one_cuda_device_with_moetune(self.model)) and _plain_torch_adamw(self.optimizer):
            from moetune.optim import AdamW

            torch_adamw = self.optimizer
            self.optimizer = AdamW(
                [{k: v for k, v in group.items() if k in ("params", "lr", "weight_decay", "betas", "eps")}
                 for group in torch_adamw.param_groups]
            )  # fmt: skip
            optimizer = self.optimizer
            self._moetune_optimizer = None if self._moetune_parallel else self.optimizer
        return optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._moetune_parallel:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        main = self.args.should_save
        if main:
            os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir, is_main_process=main)  # every rank: the experts are gathered
        if main:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._moetune_parallel:
            return super()._save_optimizer_and_scheduler(output_dir)
        from moetune.distributed import save_distributed_checkpoint

        save_distributed_checkpoint(self.model, _unwrap(self.optimizer), os.path.join(output_dir, DCP_FOLDER))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._moetune_parallel:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # The weights come back with the optimizer shards (_load_optimizer_and_scheduler).
        if not os.path.isdir(os.path.join(resume_from_checkpoint, DCP_FOLDER)):
            raise ValueError(
                f"moetune.Trainer: {resume_from_checkpoint} has no {DCP_FOLDER}/ folder; an expert-parallel run resumes "
                "only from checkpoints that moetune.Trainer wrote"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._moetune_parallel:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        from moetune.distributed import load_distributed_checkpoint

        load_distributed_checkpoint(self.model, _unwrap(self.optimizer), os.path.join(checkpoint, DCP_FOLDER))
        scheduler_file = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


class Trainer(MoetuneTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with moetune's optimizer on one GPU, that also trains moetune's
    expert-parallel models (see the module)."""


@functools.cache
def sft_trainer_class() -> type:
    """``moetune.SFTTrainer``: TRL's ``SFTTrainer`` with the same additions (TRL imported on first use)."""
    import trl

    return type("SFTTrainer", (MoetuneTrainerMixin, trl.SFTTrainer), {
        "__doc__": "TRL's ``SFTTrainer`` with moetune's optimizer on one GPU (see ``moetune.integrations.trainer``).",
        "__module__": __name__,
    })  # fmt: skip


def _holds_moetune_stack(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly inside PEFT's or another wrapper) holds a moetune decoder stack."""
    return any(hasattr(type(module), "cuda_graph_training") for module in model.modules())


def _on_one_cuda_device_with_moetune(model: torch.nn.Module) -> bool:
    return _holds_moetune_stack(model) and _trainable_on_one_cuda_device(model)


def _trainable_on_one_cuda_device(model: torch.nn.Module) -> bool:
    devices = {p.device for p in model.parameters() if p.requires_grad}
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def _unwrap(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _plain_torch_adamw(optimizer) -> bool:
    """torch's AdamW without the options moetune's AdamW does not have (amsgrad, maximize)."""
    optimizer = _unwrap(optimizer)
    return type(optimizer) is torch.optim.AdamW and not any(
        group.get("amsgrad") or group.get("maximize") for group in optimizer.param_groups
    )
