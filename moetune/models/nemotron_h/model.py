"""Nemotron-H (Nemotron 3 Nano's hybrid Mamba-2 / attention / MoE architecture) with moetune's MoE
layer: the group-limited sigmoid router -> optional latent down-projection -> dispatch -> grouped
non-gated ReLU² experts -> combine -> latent up-projection, plus the shared expert.

Subclasses Transformers' classes: the Mamba-2 and attention mixers, the dense MLP blocks, the
norms, ``generate`` and the hybrid cache are Transformers' own, and each block whose mixer is
Transformers' MoE gets moetune's instead (same parameter names: ``mixer.gate.weight``,
``mixer.experts.up_proj``, ``mixer.shared_experts.*``, ``mixer.fc1_latent_proj``). The Hub files
name the backbone ``backbone.`` and store experts one by one; both are mapped as Transformers maps
them. The multi-token-prediction weights (``mtp.*``) are ignored, as Transformers does.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from moetune.checkpoint import CheckpointLayout, FusedExpertParam
from moetune.layers.packed_documents import document_layout, per_document
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin
from moetune.models.deepseek_v3.model import build_router
from moetune.moe import GroupedExperts, MoEBlock

CHECKPOINT_LAYOUT = CheckpointLayout(
    fused_experts=(
        FusedExpertParam("up_proj", ("up_proj.weight",)),
        FusedExpertParam("down_proj", ("down_proj.weight",)),
    ),
    experts_module="mixer.experts",
    ignored_keys=(r"^mtp\.",),
    # Older files (and Transformers < 5.2x's save) say `embedding.weight` for `embeddings.weight`.
    renamed_prefixes=(("backbone.embedding.weight", "model.embeddings.weight"), ("backbone.", "model.")),
)


class NemotronHMoEBlock(MoEBlock):
    """``MoEBlock`` with Nemotron-H's latent projections around the routed experts: the router and
    the shared expert see the hidden states, the experts their projection to ``moe_latent_size``."""

    def __init__(self, *, fc1_latent_proj: nn.Module, fc2_latent_proj: nn.Module, **block) -> None:
        super().__init__(**block)
        self.fc1_latent_proj = fc1_latent_proj
        self.fc2_latent_proj = fc2_latent_proj

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])
        routing = self._modules[self._router_name](x_TH)
        latent_TL = self.fc1_latent_proj(x_TH)
        out_TL = self.dispatcher.run(latent_TL, routing, self.experts, num_experts=self.num_experts).to(latent_TL.dtype)
        out_TH = self.fc2_latent_proj(out_TL) + self.shared_experts(x_TH)
        return out_TH.view_as(hidden_BSH)


def build_moe_block(config) -> NemotronHMoEBlock:
    latent = config.moe_latent_size
    experts_width = latent if latent is not None else config.hidden_size
    return NemotronHMoEBlock(
        gate=build_router(config),
        experts=GroupedExperts(
            num_experts=config.n_routed_experts,
            hidden_size=experts_width,
            intermediate_size=config.moe_intermediate_size,
            activation=config.mlp_hidden_act,
            gated=False,
        ),
        num_experts=config.n_routed_experts,
        shared_experts=hf.NemotronHMLP(config, intermediate_size=config.moe_shared_expert_intermediate_size),
        fc1_latent_proj=nn.Identity() if latent is None else nn.Linear(config.hidden_size, latent, bias=config.mlp_bias),
        fc2_latent_proj=nn.Identity() if latent is None else nn.Linear(latent, config.hidden_size, bias=config.mlp_bias),
    )


# Transformers >= 5.2x hands every block the position_ids, where packed rows' documents restart.
_BLOCKS_SEE_POSITIONS = "position_ids" in inspect.signature(hf.NemotronHBlock.forward).parameters


class NemotronHBlock(hf.NemotronHBlock):
    """Transformers' block; an MoE mixer is replaced by moetune's (built on the meta device when
    loading, so the replaced one costs nothing there). A Mamba-2 block given packed rows (the
    position_ids restart within a row) runs each document from zero state
    (``moetune.layers.packed_documents``); Transformers' would carry the state across."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if isinstance(self.mixer, hf.NemotronHMoE):
            self.mixer = build_moe_block(config)

    def forward(self, hidden_states, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        cached = any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "cache_params"))
        if isinstance(self.mixer, hf.NemotronHMamba2Mixer) and position_ids is not None and not cached and not args:
            layout = document_layout(position_ids)
            if layout is not None:
                residual = hidden_states
                normed = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
                if getattr(self, "residual_in_fp32", False):
                    residual = residual.to(torch.float32)
                return residual + per_document(self.mixer, normed, layout)
        return super().forward(hidden_states, *args, **kwargs)


class NemotronHModel(MoetuneBaseModelMixin, hf.NemotronHModel):
    def __init__(self, config) -> None:
        hf.NemotronHPreTrainedModel.__init__(self, config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm_f = hf.NemotronHRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()


class NemotronHForCausalLM(MoetuneCausalLMMixin, hf.NemotronHForCausalLM):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable."""

    keeps_packed_documents_apart = _BLOCKS_SEE_POSITIONS
    """Whether packed rows' documents stay apart in the Mamba-2 layers too (see NemotronHBlock)."""

    checkpoint_layout = CHECKPOINT_LAYOUT
    computes_aux_loss = False

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.NemotronHPreTrainedModel, NemotronHModel)
        self.post_init()
