"""Qwen3-MoE with moetune's MoE layer (router -> dispatch -> grouped experts -> combine).

Subclasses Transformers' classes so module paths, parameter names, ``generate`` and the KV cache
are Transformers' own; only the sparse block (and, on GPU, the fused norms) are moetune's.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from moetune.models.causal_lm import MoetuneCausalLMMixin, MoetuneInitMixin
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


class Qwen3MoeDecoderLayer(hf.Qwen3MoeDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = hf.Qwen3MoeAttention(config, layer_idx)
        if is_sparse_layer(config, layer_idx):
            self.mlp = build_moe_block(config)
        else:
            self.mlp = hf.Qwen3MoeMLP(config, intermediate_size=config.intermediate_size)
        self.input_layernorm = hf.Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = hf.Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoeModel(MoetuneInitMixin, hf.Qwen3MoeModel):
    def __init__(self, config) -> None:
        hf.Qwen3MoePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = hf.Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = hf.Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class Qwen3MoeForCausalLM(MoetuneCausalLMMixin, hf.Qwen3MoeForCausalLM):
    """Same class name as Transformers', so ``config.architectures`` in saved checkpoints stays loadable."""

    def __init__(self, config) -> None:
        hf.Qwen3MoePreTrainedModel.__init__(self, config)
        self.model = Qwen3MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()
