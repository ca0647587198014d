"""GPT-OSS with moetune's MoE layer: the top-k-then-softmax router (with bias) -> dispatch ->
grouped experts (Transformers' [E, in, out] layout with biases and the clamped, interleaved
SwiGLU) -> combine.

Subclasses Transformers' classes, so module paths and parameter names (``mlp.router.weight``,
``mlp.experts.gate_up_proj``, ``mlp.experts.gate_up_proj_bias``, ...), the attention with sinks and
alternating sliding windows, ``generate`` and the KV cache are Transformers' own; the sparse
block and the RMSNorms (Transformers' GPT-OSS semantics in moetune's kernel) are moetune's. The Hub stores the experts already fused, so loading needs no
per-expert layout; its MXFP4 experts are dequantized to the model's dtype while loading (each
process reads only its experts), as the brief asks for training. Transformers supports only eager / flex / flash-kernel attention for
GPT-OSS (the sinks), so moetune's default attention here is eager; a training step without a mask
or cache skips it for ``moetune.layers.sink_attention`` (cuDNN's or torch's flash kernels with the
sinks folded in on CUDA: no [heads, S, S] scores), with RoPE applied to q and k by moetune's kernel.
"""

from __future__ import annotations

import torch
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from moetune.checkpoint import CheckpointLayout
from moetune.kernels import RMSNorm, apply_rope
from moetune.layers.document_attention import has_cache, pop_documents
from moetune.layers.sink_attention import sink_attention
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin, router_logits_recorded_from
from moetune.moe import GroupedExperts, MoEBlock, TopKThenSoftmaxRouter


class GptOssMoEBlock(MoEBlock):
    """Returns ``(hidden_states, None)``: Transformers' GPT-OSS MLP returns (hidden, router scores)
    and its decoder layer drops the second; moetune's routers report through ``router_logits``."""

    def forward(self, hidden_BSH: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(hidden_BSH), None


def build_moe_block(config) -> GptOssMoEBlock:
    return GptOssMoEBlock(
        gate=TopKThenSoftmaxRouter(
            hidden_size=config.hidden_size, num_experts=config.num_local_experts, top_k=config.num_experts_per_tok
        ),
        experts=GroupedExperts(
            num_experts=config.num_local_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            activation="clamped_swiglu",
            transposed=True,
            bias=True,
            # Transformers < 5.2x hard-codes these (no config fields).
            swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(config, "swiglu_limit", 7.0),
        ),
        num_experts=config.num_local_experts,
        router_name="router",
        router_first=True,
    )


class GptOssAttention(hf.GptOssAttention):
    """Transformers' attention (same parameters); called without a mask, cache or dropout under eager
    attention (moetune's plain causal decoder loop), it applies the causal mask, its sliding window
    and the sinks itself through ``sink_attention``, inside each document given packed rows'
    offsets (``cu_seq_lens_q``). Anything else goes to Transformers' forward."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        offsets_N, max_length = pop_documents(kwargs)
        dropout = self.attention_dropout if self.training else 0.0
        if attention_mask is not None or has_cache(kwargs) or dropout or self.config._attn_implementation != "eager":
            return super().forward(hidden_states, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings  # each frequency once, [B, S, D / 2]: the kernel's half-width tables
        q, k = apply_rope(q, k, cos, sin)
        out = sink_attention(q, k, v, self.sinks, scaling=self.scaling, sliding_window=self.sliding_window,
                             offsets_N=offsets_N, max_length=max_length)
        return self.o_proj(out.reshape(*input_shape, -1)), None


def gpt_oss_rms_norm(hidden_size: int, eps: float) -> RMSNorm:
    """``GptOssRMSNorm``'s semantics (the weight multiplied in fp32, one rounding at the end) in
    moetune's kernel: one launch each way instead of Transformers' eight elementwise ops."""
    return RMSNorm(hidden_size, eps=eps, round_before_weight=False)


class GptOssDecoderLayer(hf.GptOssDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = GptOssAttention(config=config, layer_idx=layer_idx)
        self.mlp = build_moe_block(config)
        self.input_layernorm = gpt_oss_rms_norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = gpt_oss_rms_norm(config.hidden_size, eps=config.rms_norm_eps)


CHECKPOINT_LAYOUT = CheckpointLayout(mxfp4_experts=True)  # experts stored fused on the Hub, MXFP4 or bf16


class GptOssModel(MoetuneBaseModelMixin, hf.GptOssModel):
    attention_masks_itself = True
    takes_document_offsets = True
    checkpoint_layout = CHECKPOINT_LAYOUT
    _can_record_outputs = router_logits_recorded_from(hf.GptOssModel, TopKThenSoftmaxRouter)

    def __init__(self, config) -> None:
        self._init_decoder_backbone(
            config,
            pretrained_cls=hf.GptOssPreTrainedModel,
            layer_cls=GptOssDecoderLayer,
            norm_cls=gpt_oss_rms_norm,
            rotary_cls=hf.GptOssRotaryEmbedding,
        )
        self.post_init()


class GptOssForCausalLM(MoetuneCausalLMMixin, hf.GptOssForCausalLM, GenerationMixin):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable;
    ``GenerationMixin`` a direct base, as Transformers' generative classes have it."""

    checkpoint_layout = CHECKPOINT_LAYOUT
    _can_record_outputs = GptOssModel._can_record_outputs

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.GptOssPreTrainedModel, GptOssModel)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_local_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()
