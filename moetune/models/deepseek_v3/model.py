"""DeepSeek-V3 (and Kimi-K2, which uses this architecture) with moetune's MoE layer: the
group-limited sigmoid router -> dispatch -> grouped experts -> combine, plus the shared experts.

Subclasses Transformers' classes, so module paths, parameter names (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.gate_up_proj``, ``mlp.shared_experts.*``),
multi-head latent attention's parameters, ``generate`` and the KV cache are Transformers' own (the
attention runs torch's fast kernels and keeps packed documents apart by their offsets); the sparse block and the decoder norms are moetune's. Like Transformers' model it has no aux loss (the
router balances through its score-correction bias) and ignores the multi-token-prediction layer
that Hub checkpoints store after the last decoder layer (``model.layers.61`` of 61 layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from moetune.checkpoint import SWIGLU_EXPERTS, CheckpointLayout
from moetune.kernels import RMSNorm
from moetune.kernels.mla_rope import mla_queries_keys_values
from moetune.layers.document_attention import (
    cudnn_attention_applies,
    document_causal_attention,
    flash_kernels_apply,
    has_cache,
    pop_documents,
)
from moetune.layers.gated_mlp import gated_mlp
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin, router_logits_recorded_from
from moetune.moe import GroupedExperts, GroupLimitedSigmoidRouter, MoEBlock

CHECKPOINT_LAYOUT = CheckpointLayout(
    fused_experts=SWIGLU_EXPERTS.fused_experts,
    fp8_block_scaled=True,  # the Hub's DeepSeek-V3 and Kimi-K2 files are FP8
    trailing_mtp_layers=True,  # the Hub's model.layers.61 (of 61 layers) is the MTP module
)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Transformers' rule: the first ``first_k_dense_replace`` layers are dense."""
    return layer_idx >= config.first_k_dense_replace


def router_dtype(hf_pretrained: type) -> torch.dtype | None:
    """fp32 where the installed Transformers keeps the router's weight in fp32 (its ``PreTrainedModel``
    names ``gate.weight`` in ``_keep_in_fp32_modules_strict``, and its router creates its weight and
    correction bias in fp32: Transformers 5.2x), else None: the default dtype, as its router made them before."""
    return torch.float32 if "gate.weight" in (getattr(hf_pretrained, "_keep_in_fp32_modules_strict", None) or ()) else None


def build_router(config, hf_pretrained: type = hf.DeepseekV3PreTrainedModel) -> GroupLimitedSigmoidRouter:
    """DeepSeek-V3's router from its config fields (Nemotron-H's config uses the same names; its
    ``hf_pretrained`` says whether the weight is fp32)."""
    return GroupLimitedSigmoidRouter(
        hidden_size=config.hidden_size,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        num_groups=config.n_group,
        top_k_groups=config.topk_group,
        normalize_top_k=config.norm_topk_prob,
        scaling_factor=config.routed_scaling_factor,
        dtype=router_dtype(hf_pretrained),
    )


def build_moe_block(config) -> MoEBlock:
    return MoEBlock(
        gate=build_router(config),
        experts=GroupedExperts(
            num_experts=config.n_routed_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            activation=config.hidden_act,
        ),
        num_experts=config.n_routed_experts,
        shared_experts=gated_mlp(config, hf.DeepseekV3MLP, config.moe_intermediate_size * config.n_shared_experts),
    )


class DeepseekV3Attention(hf.DeepseekV3Attention):
    """Transformers' multi-head latent attention (same parameters and math). Without a mask, cache
    or dropout moetune runs the attention itself: causal SDPA, or, given packed documents' offsets
    (``cu_seq_lens_q``), attention inside each document (``moetune.layers.document_attention``).
    Anything else goes to Transformers' forward.

    The value heads are narrower than the query / key heads (128 against 192 in DeepSeek-V3 and
    Kimi-K2), which torch's flash kernels do not take: packed rows would need a [S, S] document
    mask through SDPA. Where those kernels run (CUDA, half precision), the values are zero-padded
    to the query width and the output sliced back, as Transformers does for flash-attention-2: the
    padded columns contribute nothing, so the result is the same attention. Measured on an H200
    (Moonlight-16B-A3B, packed rows): the recipe 1.14-1.17x faster (2026-12-01, commit f0f1a98 against the tree before it).
    Unpacked rows keep the narrow values where SDPA's cuDNN kernel takes them (sm90 / sm100):
    there it runs 1.46x faster than on padded ones. Queries, keys and values are assembled by
    ``moetune.kernels.mla_rope`` (one Triton kernel each way on CUDA, the same math in torch ops
    elsewhere) instead of Transformers' splits, RoPE ops and concatenations
    (benchmarks/results/mla_attention_probe_h200_c574802.jsonl)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        # The latent norms as moetune's fused kernel (Transformers' RMSNorm is five elementwise
        # kernels each way); same parameter name and eps (Transformers' default, not the config's).
        eps = self.kv_a_layernorm.variance_epsilon
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=eps)
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=eps)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        offsets_N, max_length = pop_documents(kwargs)
        dropout = self.attention_dropout if self.training else 0.0
        plain_causal = offsets_N is None and self.config._attn_implementation == "sdpa"
        if has_cache(kwargs) or dropout or attention_mask is not None or not (offsets_N is not None or plain_causal):
            return super().forward(hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        B, S = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        kv_latent, k_rot_BSR = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                           [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # fmt: skip
        kv_BSHX = self.kv_b_proj(self.kv_a_layernorm(kv_latent))
        kv_BSHX = kv_BSHX.view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        q_BSHD = q.view(B, S, -1, self.qk_head_dim)
        # Values as narrow as Transformers' where the kernel takes them, else padded to the query width.
        pad_values = (self.v_head_dim < self.qk_head_dim and flash_kernels_apply(q_BSHD)
                      and not (offsets_N is None and cudnn_attention_applies(q_BSHD)))  # fmt: skip
        cos, sin = position_embeddings
        # One Triton kernel each way on CUDA; elsewhere the same math in torch ops.
        q_BSHD, k_BSHD, v_BSHD = mla_queries_keys_values(q_BSHD, kv_BSHX, k_rot_BSR, cos, sin,
                                                         interleaved=self.config.rope_interleave,
                                                         pad_values=pad_values)  # fmt: skip
        if offsets_N is None:
            out_BSHD = F.scaled_dot_product_attention(q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2),
                                                      is_causal=True, scale=self.scaling).transpose(1, 2)  # fmt: skip
        else:
            out_BSHD = document_causal_attention(q_BSHD, k_BSHD, v_BSHD, offsets_N, max_length=max_length or S,
                                                 scaling=self.scaling)  # fmt: skip
        out_BSHD = out_BSHD[..., : self.v_head_dim]
        return self.o_proj(out_BSHD.reshape(B, S, -1)), None


class DeepseekV3DecoderLayer(hf.DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = DeepseekV3Attention(config=config, layer_idx=layer_idx)
        self.mlp = build_moe_block(config) if is_sparse_layer(config, layer_idx) else gated_mlp(config, hf.DeepseekV3MLP)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV3Model(MoetuneBaseModelMixin, hf.DeepseekV3Model):
    takes_document_offsets = True
    checkpoint_layout = CHECKPOINT_LAYOUT
    _can_record_outputs = router_logits_recorded_from(hf.DeepseekV3Model, GroupLimitedSigmoidRouter)

    def __init__(self, config) -> None:
        self._init_decoder_backbone(
            config,
            pretrained_cls=hf.DeepseekV3PreTrainedModel,
            layer_cls=DeepseekV3DecoderLayer,
            norm_cls=RMSNorm,
            rotary_cls=hf.DeepseekV3RotaryEmbedding,
        )
        self.post_init()


class DeepseekV3ForCausalLM(MoetuneCausalLMMixin, hf.DeepseekV3ForCausalLM, GenerationMixin):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable;
    ``GenerationMixin`` a direct base, as Transformers' generative classes have it."""

    checkpoint_layout = CHECKPOINT_LAYOUT
    _can_record_outputs = DeepseekV3Model._can_record_outputs
    computes_aux_loss = False

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.DeepseekV3PreTrainedModel, DeepseekV3Model)
        self.post_init()
