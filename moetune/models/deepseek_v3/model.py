"""DeepSeek-V3 (and Kimi-K2, which uses this architecture) with moetune's MoE layer: the
group-limited sigmoid router -> dispatch -> grouped experts -> combine, plus the shared experts.

Subclasses Transformers' classes, so module paths, parameter names (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.gate_up_proj``, ``mlp.shared_experts.*``),
multi-head latent attention, ``generate`` and the KV cache are Transformers' own; the sparse
block and the decoder norms are moetune's. Like Transformers' model it has no aux loss (the
router balances through its score-correction bias) and ignores the multi-token-prediction layer
that Hub checkpoints store as ``model.layers.61``.
"""

from __future__ import annotations

from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from moetune.checkpoint import SWIGLU_EXPERTS, CheckpointLayout
from moetune.kernels import RMSNorm
from moetune.models.causal_lm import MoetuneBaseModelMixin, MoetuneCausalLMMixin
from moetune.moe import GroupedExperts, GroupLimitedSigmoidRouter, MoEBlock

CHECKPOINT_LAYOUT = CheckpointLayout(
    fused_experts=SWIGLU_EXPERTS.fused_experts,
    fp8_block_scaled=True,  # the Hub's DeepSeek-V3 and Kimi-K2 files are FP8
    ignored_keys=(*SWIGLU_EXPERTS.ignored_keys, r"^model\.layers\.61\."),  # Transformers' rule, as its class
)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Transformers' rule: the first ``first_k_dense_replace`` layers are dense."""
    return layer_idx >= config.first_k_dense_replace


def build_router(config) -> GroupLimitedSigmoidRouter:
    """DeepSeek-V3's router from its config fields (Nemotron-H's config uses the same names)."""
    return GroupLimitedSigmoidRouter(
        hidden_size=config.hidden_size,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        num_groups=config.n_group,
        top_k_groups=config.topk_group,
        normalize_top_k=config.norm_topk_prob,
        scaling_factor=config.routed_scaling_factor,
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
        shared_experts=hf.DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts),
    )


class DeepseekV3DecoderLayer(hf.DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = hf.DeepseekV3Attention(config=config, layer_idx=layer_idx)
        self.mlp = build_moe_block(config) if is_sparse_layer(config, layer_idx) else hf.DeepseekV3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV3Model(MoetuneBaseModelMixin, hf.DeepseekV3Model):
    def __init__(self, config) -> None:
        self._init_decoder_backbone(
            config,
            pretrained_cls=hf.DeepseekV3PreTrainedModel,
            layer_cls=DeepseekV3DecoderLayer,
            norm_cls=RMSNorm,
            rotary_cls=hf.DeepseekV3RotaryEmbedding,
        )
        self.post_init()


class DeepseekV3ForCausalLM(MoetuneCausalLMMixin, hf.DeepseekV3ForCausalLM):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable."""

    checkpoint_layout = CHECKPOINT_LAYOUT
    computes_aux_loss = False

    def __init__(self, config) -> None:
        self._init_decoder_lm(config, hf.DeepseekV3PreTrainedModel, DeepseekV3Model)
        self.post_init()
