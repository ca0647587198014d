"""Qwen3-MoE with moetune's MoE layer (router -> dispatch -> grouped experts -> combine).

Subclasses Transformers' classes so module paths, parameter names, ``generate`` and the KV cache
are Transformers' own; only the sparse block (and, on GPU, the fused norms) are moetune's.
"""

from __future__ import annotations

from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from moetune.kernels import RMSNorm, apply_rope
from moetune.kernels.qk_norm_rope import qk_norm_rope
from moetune.layers.document_attention import document_causal_attention, pop_documents
from moetune.layers.gated_mlp import gated_mlp
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin, router_logits_recorded_from
from moetune.moe import GroupedExperts, MoEBlock, SoftmaxTopKRouter


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Transformers' rule: MoE unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    return (
        layer_idx not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


def build_moe_block(config) -> MoEBlock:
    return MoEBlock(
        gate=SoftmaxTopKRouter(
            hidden_size=config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            normalize_top_k=config.norm_topk_prob,
        ),
        experts=GroupedExperts(
            num_experts=config.num_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            activation=config.hidden_act,
        ),
        num_experts=config.num_experts,
    )


class Qwen3MoeAttention(hf.Qwen3MoeAttention):
    """Transformers' attention with the q/k RMSNorm and RoPE fused into one kernel each way
    (``moetune.kernels.qk_norm_rope``; about thirty elementwise ops in Transformers), applied in
    [B, S, heads, D] layout before the single transpose for attention. Given packed documents'
    offsets (``cu_seq_lens_q``, Transformers' flash-attention kwargs) and no KV cache, attention
    stays inside each document without a mask (``moetune.layers.document_attention``)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _fused_norm_rope(self) -> bool:
        """One kernel for both norms and RoPE when the norms are moetune's own, unhooked, with one eps."""
        norms = (self.q_norm, self.k_norm)
        return (
            all(type(n) is RMSNorm and not (n._forward_hooks or n._forward_pre_hooks) for n in norms)
            and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon
        )

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        # Transformers >= 5.24 calls the KV cache `cache`, earlier versions `past_key_values`.
        cache = kwargs.pop("cache", None)
        cache = cache if cache is not None else past_key_values
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        offsets_N, max_length = pop_documents(kwargs)
        q_BSHD = self.q_proj(hidden_states).view(hidden_shape)
        k_BSHD = self.k_proj(hidden_states).view(hidden_shape)
        v_BSHD = self.v_proj(hidden_states).view(hidden_shape)
        cos, sin = position_embeddings
        if self._fused_norm_rope():
            q_BSHD, k_BSHD = qk_norm_rope(
                q_BSHD, k_BSHD, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.variance_epsilon
            )
        else:  # a norm replaced or hooked (adapters, user hooks): call the modules
            q_BSHD, k_BSHD = apply_rope(self.q_norm(q_BSHD), self.k_norm(k_BSHD), cos, sin, unsqueeze_dim=2)
        if offsets_N is not None and cache is None and self.sliding_window is None:
            # Packed documents with known offsets (moetune.layers.document_attention): no mask, no sync.
            out_BSHD = document_causal_attention(
                q_BSHD, k_BSHD, v_BSHD, offsets_N, max_length=max_length or q_BSHD.shape[1], scaling=self.scaling
            )
            return self.o_proj(out_BSHD.reshape(*hidden_states.shape[:-1], -1)), None
        q_BHSD, k_BHSD, v_BHSD = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2)
        if cache is not None:
            k_BHSD, v_BHSD = cache.update(k_BHSD, v_BHSD, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, hf.eager_attention_forward)
        out_BSHD, weights = attention(
            self,
            q_BHSD,
            k_BHSD,
            v_BHSD,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(out_BSHD.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


class Qwen3MoeDecoderLayer(hf.Qwen3MoeDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        if is_sparse_layer(config, layer_idx):
            self.mlp = build_moe_block(config)
        else:
            self.mlp = gated_mlp(config, hf.Qwen3MoeMLP)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoeModel(MoetuneBaseModelMixin, hf.Qwen3MoeModel):
    takes_document_offsets = True
    _can_record_outputs = router_logits_recorded_from(hf.Qwen3MoeModel, SoftmaxTopKRouter)
    def __init__(self, config) -> None:
        self._init_decoder_backbone(
            config,
            pretrained_cls=hf.Qwen3MoePreTrainedModel,
            layer_cls=Qwen3MoeDecoderLayer,
            norm_cls=RMSNorm,
            rotary_cls=hf.Qwen3MoeRotaryEmbedding,
        )
        self.post_init()


class Qwen3MoeForCausalLM(MoetuneCausalLMMixin, hf.Qwen3MoeForCausalLM, GenerationMixin):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable;
    ``GenerationMixin`` a direct base, as Transformers' generative classes have it."""

    _can_record_outputs = Qwen3MoeModel._can_record_outputs

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.Qwen3MoePreTrainedModel, Qwen3MoeModel)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()
