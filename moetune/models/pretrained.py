"""What both of a family's moetune classes (the backbone and the causal LM) add to their Transformers
parents, so that code written for Transformers' classes finds the same API on moetune's:

- Loading and saving through moetune's checkpoint code. ``from_pretrained`` on the class loads as
  ``moetune.AutoModelForCausalLM.from_pretrained`` does (Hub per-expert experts fused, the checkpoint
  checked from its headers; Transformers' own loader treats moetune's classes as custom code and
  would leave per-expert experts as initialised); ``save_pretrained`` streams the Hub layout;
  ``load_state_dict`` takes it.
- Transformers' experts-implementation API (``set_experts_implementation``, the config's
  ``experts_implementation``) on moetune's experts: Transformers' names map onto moetune's experts
  backends as ``from_pretrained(experts_implementation=...)`` maps them.
- Weight init for moetune's MoE modules, so ``from_config`` gives Transformers' init scheme.
- ``_can_record_outputs`` naming moetune's routers for ``router_logits``, as Transformers declares its own.
- Transformers' checkpoint conversions apply to them (``is_custom_code`` False): same names, same layouts.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetune.checkpoint import SWIGLU_EXPERTS, CheckpointLayout, save_hf_checkpoint
from moetune.checkpoint.loader import load_per_expert_tensors
from moetune.loading_kwargs import EXPERTS_IMPLEMENTATIONS, experts_backend_for
from moetune.models.options import set_moe_options
from moetune.moe import ROUTERS, GroupedExperts, GroupLimitedSigmoidRouter, TopKThenSoftmaxRouter

try:  # Transformers >= 5.0 records which tensors were initialised, so loading can skip them.
    from transformers import initialization as hf_init
except ImportError:  # pragma: no cover
    hf_init = torch.nn.init


class MoetunePreTrainedMixin:
    """Put it first among the bases of a family's backbone and causal LM (through
    ``MoetuneBaseModelMixin`` / ``MoetuneCausalLMMixin``)."""

    checkpoint_layout: CheckpointLayout = SWIGLU_EXPERTS
    """How the family's Hub checkpoints name and lay out its tensors (``moetune.checkpoint``)."""

    loader: Callable[..., Any] | None = None
    """moetune's loader, ``moetune.auto.load_pretrained``. It picks and builds these classes (it sits above
    them), so ``moetune.auto`` hands it in when imported, which any import of moetune does first."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Transformers' ``from_pretrained`` arguments plus ``MoetuneOptions``, loaded by moetune's loader
        exactly as ``moetune.AutoModelForCausalLM.from_pretrained`` loads the family; the backbone also
        reads a causal LM's checkpoint (its ``model.`` tensors), as Transformers' ``AutoModel`` does."""
        return MoetunePreTrainedMixin.loader(pretrained_model_name_or_path, *model_args, model_class=cls, **kwargs)

    def _init_weights(self, module: torch.nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, GroupedExperts):
            hf_init.normal_(module.in_proj, mean=0.0, std=std)
            hf_init.normal_(module.down_proj, mean=0.0, std=std)
            if module.has_bias:
                hf_init.zeros_(getattr(module, f"{module._in_name}_bias"))
                hf_init.zeros_(module.down_proj_bias)
        elif isinstance(module, ROUTERS):
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, GroupLimitedSigmoidRouter):
                hf_init.zeros_(module.e_score_correction_bias)
            elif isinstance(module, TopKThenSoftmaxRouter):
                hf_init.normal_(module.bias, mean=0.0, std=std)

    @classmethod
    def is_custom_code(cls) -> bool:
        # Transformers skips its checkpoint conversions (Hub per-expert <-> fused) for classes defined
        # outside it. moetune's hold Transformers' parameters under Transformers' names and layouts, so
        # the conversions hold for them as for Transformers' own (its loader, PEFT's key mapping).
        return cls.is_remote_code()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # Transformers decides from the modeling file's source (its `@use_experts_implementation`),
        # which moetune's experts do not use; they take every implementation name (mapped below).
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Transformers' default (``grouped_mm``) when none is requested; a name neither Transformers
        nor moetune knows is a ValueError, as in Transformers."""
        requested = "grouped_mm" if requested_experts is None else requested_experts
        experts_backend_for(requested, "auto", self.config.model_type, warn=False)
        return requested

    def set_experts_implementation(self, experts_implementation: str | dict) -> None:
        """Transformers' method (the config records the name) that also switches moetune's experts:
        ``eager`` runs the per-expert loop, ``grouped_mm`` the grouped GEMM where it runs (moetune's
        ``auto``), ``moetune`` leaves the backend as it is; Transformers' other kernels (``batched_mm``,
        ...) are for its own experts modules and keep moetune's (with a warning)."""
        super().set_experts_implementation(experts_implementation)
        self._apply_experts_implementation(warn=True)

    @contextlib.contextmanager
    def _optimize_model_for_decode(self):
        """Transformers' ``generate`` switches ``grouped_mm`` experts to ``batched_mm`` for decoding on
        GPUs, a kernel of its own experts modules that moetune's experts would refuse with a warning on
        every call: moetune's experts keep their backend, which decodes with the same grouped GEMM."""
        yield

    def post_init(self) -> None:
        super().post_init()
        # A config that names an implementation (Transformers' `experts_implementation=` recorded
        # in it) builds the experts with the backend it maps to, as Transformers' classes do.
        self._apply_experts_implementation(warn=False)

    def _apply_experts_implementation(self, *, warn: bool) -> None:
        implementation = getattr(self.config, "_experts_implementation", None)
        if implementation in EXPERTS_IMPLEMENTATIONS:
            set_moe_options(self, experts_backend=EXPERTS_IMPLEMENTATIONS[implementation])
        elif implementation is not None:  # "moetune", or a kernel of Transformers' own experts: backend kept
            current = next((m.backend for m in self.modules() if isinstance(m, GroupedExperts)), "auto")
            experts_backend_for(implementation, current, self.config.model_type, warn=warn)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict``, also taking the experts in the Hub's per-expert layout, which
        ``save_pretrained`` writes by default: Trainer's ``resume_from_checkpoint`` and
        ``load_best_model_at_end`` read a checkpoint's safetensors back through this method, and
        would otherwise leave every expert weight as it was (Transformers v5's own MoE models do,
        with a missing-keys warning). Keys under the Hub's names (Nemotron-H's ``backbone.``) are read
        under the model's, as ``from_pretrained`` reads them."""
        layout = self.checkpoint_layout
        if any(layout.canonical(key) != key for key in state_dict):
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = {layout.canonical(key): tensor for key, tensor in state_dict.items()}
            if metadata is not None:
                state_dict = OrderedDict(state_dict)
                state_dict._metadata = metadata  # torch's per-module versions
        loaded = load_per_expert_tensors(self, state_dict, layout)
        if loaded is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        rest, filled = loaded
        parameters = dict(self.named_parameters())
        # The filled parameters hold their new values already; loading them onto themselves keeps
        # torch's own missing / unexpected accounting (and strict's error) for everything else.
        rest.update({name: parameters[name] for name in filled})
        return super().load_state_dict(rest, strict=strict, assign=assign)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool | None = None,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = "50GB",
        variant: str | None = None,
        save_original_format: bool = True,
        **kwargs,
    ):
        """Like Transformers': per-expert Hub layout by default, fused with ``save_original_format=False``;
        ``variant`` names the weight files ``model.<variant>.safetensors`` (or its shards and
        ``model.safetensors.index.<variant>.json``), which ``from_pretrained(variant=...)`` loads;
        with ``push_to_hub`` the main process returns the upload's commit info.

        Under FSDP2 / expert parallelism (a model moetune sharded) every rank must call it (tensors are
        gathered one by one); only ``is_main_process`` writes and pushes, by default global rank 0
        (Transformers' default, True, would have every rank write the same files).
        """
        if is_main_process is None:
            is_main_process = _is_main_rank(self)
        save_hf_checkpoint(
            self,
            save_directory,
            layout=self.checkpoint_layout,
            per_expert=save_original_format,
            max_shard_size=max_shard_size,
            is_main_process=is_main_process,
            state_dict=state_dict,
            variant=variant,
        )
        if push_to_hub and is_main_process:
            from huggingface_hub import HfApi

            # Transformers' rule: the folder's name unless repo_id says otherwise; create_repo returns
            # the full "namespace/name" id, which the upload needs.
            repo_id = kwargs.pop("repo_id", None) or Path(save_directory).name
            api = HfApi(token=kwargs.pop("token", None))
            repo_id = api.create_repo(repo_id, private=kwargs.pop("private", None), exist_ok=True).repo_id
            return api.upload_folder(
                repo_id=repo_id, folder_path=save_directory, commit_message=kwargs.pop("commit_message", None),
                commit_description=kwargs.pop("commit_description", None), revision=kwargs.pop("revision", None),
                create_pr=kwargs.pop("create_pr", False),
            )  # fmt: skip
        return None

    def push_to_hub(self, repo_id: str, *args, **kwargs):
        """Transformers' ``push_to_hub``; for a model moetune sharded, a collective: every rank calls it,
        every rank takes part in gathering the tensors, and global rank 0 writes the checkpoint to a
        temporary folder and uploads it (Transformers' version would have each rank save and upload,
        and deadlock when only rank 0 calls it). Options by keyword: ``commit_message``,
        ``commit_description``, ``private``, ``token``, ``revision``, ``create_pr``, ``max_shard_size``."""
        from moetune.distributed.mesh import is_sharded_by_moetune

        if not is_sharded_by_moetune(self):
            return super().push_to_hub(repo_id, *args, **kwargs)
        if args:
            raise TypeError("push_to_hub on a model moetune sharded: pass the options after repo_id by keyword")
        supported = {"commit_message", "commit_description", "private", "token", "revision", "create_pr", "max_shard_size"}
        unsupported = sorted(k for k, v in kwargs.items() if k not in supported and v is not None)
        if unsupported:
            raise ValueError(
                f"push_to_hub on a model moetune sharded does not take {unsupported} (supported: {sorted(supported)}); "
                "add model-card tags on the Hub, or push a checkpoint loaded without ep_size / device_mesh"
            )
        kwargs = {k: v for k, v in kwargs.items() if k in supported}
        with tempfile.TemporaryDirectory(prefix="moetune-push-") as folder:
            return self.save_pretrained(folder, push_to_hub=True, repo_id=repo_id, **kwargs)


def _is_main_rank(model: torch.nn.Module) -> bool:
    """Who writes a checkpoint by default: global rank 0 for a model moetune sharded (every rank calls
    ``save_pretrained`` to gather it), the caller otherwise (Transformers' default)."""
    import torch.distributed as dist

    from moetune.distributed.mesh import is_sharded_by_moetune

    return not (is_sharded_by_moetune(model) and dist.is_initialized()) or dist.get_rank() == 0
