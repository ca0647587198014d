"""Nemotron-H (Nemotron 3 Nano's hybrid Mamba-2 / attention / MoE architecture) with moetune's MoE
layer: the group-limited sigmoid router -> optional latent down-projection -> dispatch -> grouped
non-gated ReLU² experts -> combine -> latent up-projection, plus the shared expert.

Subclasses Transformers' classes: the attention mixers, the dense MLP blocks, ``generate`` and
the hybrid cache are Transformers' own, the block norms Transformers' semantics in moetune's kernel; the Mamba-2 mixers keep Transformers'
module and parameters with moetune's training forward (``moetune.layers.mamba2``), and each block
whose mixer is Transformers' MoE gets moetune's instead (same parameter names: ``mixer.gate.weight``,
``mixer.experts.up_proj``, ``mixer.shared_experts.*``, ``mixer.fc1_latent_proj``). The Hub files
name the backbone ``backbone.`` and store experts one by one; both are mapped as Transformers maps
them. The multi-token-prediction weights (``mtp.*``) are ignored, as Transformers does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from moetune.checkpoint import CheckpointLayout, FusedExpertParam
from moetune.kernels import RMSNorm
from moetune.layers.document_attention import document_causal_attention, has_cache, pop_documents
from moetune.layers.mamba2 import causal_conv1d, chunked_scan, document_ids, gated_rms_norm, zero_padding
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin, router_logits_recorded_from
from moetune.models.deepseek_v3.model import build_router
from moetune.moe import GroupedExperts, GroupLimitedSigmoidRouter, MoEBlock

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
        gate=build_router(config, hf.NemotronHPreTrainedModel),
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


class NemotronHMamba2Mixer(hf.NemotronHMamba2Mixer):
    """Transformers' Mamba-2 mixer (same parameters and math) whose cache-free forward, training's,
    runs ``moetune.layers.mamba2``: the convolution and the chunked scan as batched matmuls, and
    packed documents (``seq_idx``) kept apart. With a cache (generation) Transformers' forward runs."""

    def forward(self, hidden_states: torch.Tensor, *args, seq_idx: torch.Tensor | None = None, **kwargs):
        if args or has_cache(kwargs):
            return super().forward(hidden_states, *args, **kwargs)
        attention_mask = kwargs.get("attention_mask")
        batch, seq_len, _ = hidden_states.shape
        projected = self.in_proj(zero_padding(hidden_states, attention_mask))
        gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv = causal_conv1d(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, seq_idx_BS=seq_idx,
                             activation=self.activation)  # self.act's ACT2FN name
        xBC = zero_padding(conv.to(xBC.dtype), attention_mask)
        x, B, C = xBC.split([self.intermediate_size, self.n_groups * self.ssm_state_size,
                             self.n_groups * self.ssm_state_size], dim=-1)
        y = chunked_scan(
            x.view(batch, seq_len, self.num_heads, self.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.view(batch, seq_len, self.n_groups, self.ssm_state_size),
            C.view(batch, seq_len, self.n_groups, self.ssm_state_size),
            chunk_size=self.chunk_size,
            D_H=self.D,
            dt_bias_H=self.dt_bias,
            dt_limit=self._dt_limit(),
            seq_idx_BS=seq_idx,
        )
        y = gated_rms_norm(self.norm, y.reshape(batch, seq_len, -1), gate)
        return self.out_proj(y.to(hidden_states.dtype))


    def _dt_limit(self) -> tuple[float, float]:
        # Transformers' torch path clamps dt below at time_step_min: from 5.1x through
        # time_step_limit, in 5.10 directly (its time_step_limit then is the config's (0, inf)).
        low, high = self.time_step_limit
        return max(low, getattr(self, "time_step_min", 0.0)), high


class NemotronHAttention(hf.NemotronHAttention):
    """Transformers' attention (no RoPE in Nemotron-H); given packed documents' offsets
    (``cu_seq_lens_q``) and no KV cache, attention stays inside each document without a mask
    (``moetune.layers.document_attention``). Anything else goes to Transformers' forward."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs):
        offsets_N, max_length = pop_documents(kwargs)
        if offsets_N is None or has_cache(kwargs) or args or attention_mask is not None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        out_BSHD = document_causal_attention(
            self.q_proj(hidden_states).view(hidden_shape), self.k_proj(hidden_states).view(hidden_shape),
            self.v_proj(hidden_states).view(hidden_shape), offsets_N,
            max_length=max_length or hidden_states.shape[1], scaling=self.scaling,
        )  # fmt: skip
        return self.o_proj(out_BSHD.reshape(*hidden_states.shape[:-1], -1)), None


def _random_state() -> tuple:
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.get_rng_state(), torch.cuda.get_rng_state() if cuda else None


def _set_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class NemotronHBlock(hf.NemotronHBlock):
    """Transformers' block with moetune's mixers: an MoE mixer is replaced by moetune's (built on the
    meta device when loading, so the replaced one costs nothing there), a Mamba-2 mixer becomes
    ``NemotronHMamba2Mixer`` (same module, same parameters). Given packed rows (the position_ids
    restart within a row) a Mamba-2 block runs each document from zero state; Transformers' would
    carry the state and the convolution across."""

    def __init__(self, config, layer_idx: int) -> None:
        random_state = _random_state()
        super().__init__(config, layer_idx)
        self.norm = nemotron_h_rms_norm(config)
        if isinstance(self.mixer, hf.NemotronHMoE):
            # Transformers' MoE mixer drew its linears' initial values from the random stream; moetune's,
            # built in its place, draws the same ones again from where it started, so that the stream
            # goes on as in Transformers' model (a seeded from_config then draws its weights).
            _set_random_state(random_state)
            self.mixer = build_moe_block(config)
        elif type(self.mixer) is hf.NemotronHMamba2Mixer:
            self.mixer.__class__ = NemotronHMamba2Mixer  # adds a forward only: no state to move
        elif type(self.mixer) is hf.NemotronHAttention:
            self.mixer.__class__ = NemotronHAttention

    def forward(self, hidden_states, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        if isinstance(self.mixer, NemotronHMamba2Mixer) and position_ids is not None and not has_cache(kwargs) and not args:
            residual = hidden_states
            normed = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
            if getattr(self, "residual_in_fp32", False):
                residual = residual.to(torch.float32)
            mixed = self.mixer(normed, attention_mask=kwargs.get("attention_mask"),
                               seq_idx=document_ids(position_ids.expand(hidden_states.shape[0], -1)))
            return residual + mixed
        return super().forward(hidden_states, *args, **kwargs)


def nemotron_h_rms_norm(config) -> RMSNorm:
    """``NemotronHRMSNorm``'s semantics (the weight multiplied in fp32, one rounding at the end) in
    moetune's kernel: one launch each way instead of Transformers' eight elementwise ops."""
    return RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, round_before_weight=False)


class NemotronHModel(MoetuneBaseModelMixin, hf.NemotronHModel):
    takes_document_offsets = True
    embedding_name, final_norm_name = "embeddings", "norm_f"
    checkpoint_layout = CHECKPOINT_LAYOUT
    _can_record_outputs = router_logits_recorded_from(hf.NemotronHModel, GroupLimitedSigmoidRouter)

    def __init__(self, config) -> None:
        hf.NemotronHPreTrainedModel.__init__(self, config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm_f = nemotron_h_rms_norm(config)
        self.post_init()


class NemotronHForCausalLM(MoetuneCausalLMMixin, hf.NemotronHForCausalLM, GenerationMixin):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable;
    ``GenerationMixin`` a direct base, as Transformers' generative classes have it."""

    keeps_packed_documents_apart = True
    """Packed rows' documents stay apart in the Mamba-2 layers too (see NemotronHBlock): given their
    offsets, moetune's decoder loop hands every block the position_ids (Transformers' own forward
    does from 5.1x on)."""

    checkpoint_layout = CHECKPOINT_LAYOUT
    computes_aux_loss = False
    _can_record_outputs = NemotronHModel._can_record_outputs

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.NemotronHPreTrainedModel, NemotronHModel)
        self.post_init()
