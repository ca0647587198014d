"""What every moetune causal-LM class adds to its Transformers parent.

- The loss: the LM head and cross-entropy fused chunk-wise (``moetune.layers.linear_cross_entropy``),
  so training never materialises [tokens, vocab] logits. ``out.logits`` is then None; pass
  ``return_logits=True`` (or set ``model.return_logits_in_training = True``) to get them, which
  also switches to Transformers' own loss path.
- The aux loss: router logits are captured from moetune's routers and fed to the same
  load-balancing loss as Transformers'.
- The backbone's forward keeps the signature of its Transformers parent (code that inspects it, as
  ``generate`` and Transformers' tests do, finds the same arguments).
- What both classes share (loading through moetune's loader, the experts-implementation API, weight
  init, saving): ``moetune.models.pretrained``.

The inner base model's forward (masks, KV cache, RoPE, decoder loop) stays Transformers' own,
which keeps ``generate`` and every cache type working across Transformers versions, except for
the plain causal case (see ``MoetuneBaseModelMixin``).
"""

# No `from __future__ import annotations`: the forwards' annotations stay types, which Transformers'
# tests read (`forward.__annotations__["return"]`) to learn what a model returns.

import inspect

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import TransformersKwargs
from transformers.utils.output_capturing import OutputRecorder
from typing_extensions import Unpack

from moetune.layers import lm_head_cross_entropy, shift_labels_for_causal_lm
from moetune.layers.document_attention import OFFSETS_KEY, offsets_from_positions
from moetune.models.pretrained import MoetunePreTrainedMixin
from moetune.moe import ROUTERS, capture_router_logits, load_balancing_loss
from moetune.training.graphed_backbone import LABELS_KEY, ScoredLabels, training_graphs

# Transformers 5.24 renamed the cache field of model outputs from `past_key_values` to `cache`.
_CACHE_FIELD = "cache" if "cache" in MoeCausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# Attention implementations for which "no mask" means causal attention (SDPA's is_causal).
_IS_CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


class MoetuneBaseModelMixin(MoetunePreTrainedMixin):
    """The inner (decoder-only) model's forward returns moetune's router logits in
    ``router_logits`` when asked (``output_router_logits`` or the config's default), as
    Transformers' MoE base models do: callers that run the backbone themselves (TRL's fused
    LM-head loss, custom heads) compute the aux loss from them.

    Plain causal batches (no attention mask, no position ids, no KV cache: a training step on
    full or packed-to-length sequences) skip Transformers' mask preparation and run the decoder
    loop with no mask, which SDPA / flash attention treat as causal. Transformers would check
    the default position ids for packed sequences, which reads a device value on the host every
    forward (a synchronisation) and, inside a CUDA-graph capture where it cannot read it,
    materialises a [S, S] mask that makes cuDNN attention ~3x slower.

    Packed documents take the same loop when the model's attention takes their offsets
    (``takes_document_offsets``) and the caller passes them (``cu_seq_lens_q`` with the
    documents' ``position_ids``; ``moetune.layers.document_attention``): no mask is built either.
    """

    takes_document_offsets: bool = False
    """Whether every layer's attention honours ``cu_seq_lens_q`` (the documents of packed rows)."""

    cuda_graph_training: bool = True
    """Whether training forwards and backwards on CUDA replay CUDA graphs where that is exact
    (``moetune.training.graphed_backbone``; ``MoetuneOptions.cuda_graphs``)."""

    embedding_name: str = "embed_tokens"
    final_norm_name: str = "norm"
    """The backbone's input embedding and final norm attributes (Nemotron-H: ``embeddings``,
    ``norm_f``); a backbone without ``rotary_emb`` (Nemotron-H's attention has no RoPE) gets no
    position embeddings in the plain loop."""

    attention_masks_itself: bool = False
    """Whether every layer's attention, given no mask under eager attention, applies the causal mask
    and its own sliding window itself (moetune's GPT-OSS attention), so that plain causal batches
    need no mask from Transformers either."""

    def _init_decoder_backbone(self, config, *, pretrained_cls: type, layer_cls: type, norm_cls: type, rotary_cls: type) -> None:
        """Transformers' decoder-only ``XModel.__init__`` up to ``post_init`` (left to the caller):
        embeddings, ``layer_cls(config, i)`` per layer, the final ``norm_cls`` and RoPE, in
        Transformers' order (so state dicts list the same keys in the same order)."""
        pretrained_cls.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = torch.nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_cls(config=config)
        self.gradient_checkpointing = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" not in vars(cls):
            cls.forward = _forward_with_signature_of(_transformers_parent(cls))

    def _moetune_forward(self, *, output_router_logits: bool | None = None, return_dict: bool | None = None, **kwargs):
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        if return_dict is None:  # Transformers' can_return_tuple: the config's return_dict by default
            return_dict = getattr(self.config, "return_dict", True)
        # The backbone returns a ModelOutput (so the router logits can be added), made a tuple here.
        kwargs["return_dict"] = True
        labels = kwargs.pop(LABELS_KEY, None)  # the causal LM's targets, so that padding is checked against them
        outputs = None
        graphs = training_graphs(self)
        if graphs is not None:  # a training step on CUDA: replayed from CUDA graphs where that is exact
            outputs = graphs.run(kwargs, output_router_logits=output_router_logits, forward=self._eager_outputs,
                                 labels=labels)  # fmt: skip
        if outputs is None:
            outputs = self._eager_outputs(kwargs, output_router_logits)
            if graphs is not None and torch.is_grad_enabled():
                graphs.track_eager(outputs)
        return outputs if return_dict else outputs.to_tuple()

    def _eager_outputs(self, kwargs: dict, output_router_logits: bool):
        if not output_router_logits:
            return self._backbone_forward(**kwargs)
        with capture_router_logits(self, ROUTERS) as router_logits:
            outputs = self._backbone_forward(**kwargs)
        # By key: a field that was None is missing from the output's keys, which to_tuple reads.
        outputs["router_logits"] = tuple(router_logits)
        return outputs

    def _backbone_forward(self, **kwargs):
        kwargs = self._with_documents_from_positions(kwargs)
        if not self._is_plain_causal(kwargs):
            if self.training and kwargs.get("past_key_values") is None and kwargs.get("cache") is None:
                # A training forward needs no KV cache (Transformers builds one whenever
                # config.use_cache is on; its hybrid Nemotron-H cache even fails when layer 0 holds
                # no attention or Mamba state). A caller's explicit use_cache still wins.
                kwargs.setdefault("use_cache", False)
            # moetune's capture (in _eager_outputs) reports the router logits: Transformers' own
            # recording of them (this class's _can_record_outputs) stays off.
            return super().forward(output_router_logits=False, **kwargs)
        input_ids, inputs_embeds = kwargs.pop("input_ids", None), kwargs.pop("inputs_embeds", None)
        position_ids = kwargs.pop("position_ids", None)  # only with document offsets (packed rows)
        for name in ("attention_mask", "cache", "past_key_values", "use_cache", "return_dict"):
            kwargs.pop(name, None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = getattr(self, self.embedding_name)(input_ids)
        rotary = getattr(self, "rotary_emb", None)
        if rotary is not None:
            positions = position_ids
            if positions is None:
                positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
            kwargs["position_embeddings"] = rotary(inputs_embeds, positions)
        # Layers get position_ids only for packed rows: with none, they know each row is one
        # sequence (Nemotron-H's Mamba-2 blocks then skip the per-document masks).
        hidden = inputs_embeds
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids, **kwargs)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return MoeModelOutputWithPast(last_hidden_state=getattr(self, self.final_norm_name)(hidden))

    def _with_documents_from_positions(self, kwargs: dict) -> dict:
        """Packed rows given by their ``position_ids`` alone (TRL's packing under SDPA) get their
        documents' offsets (``offsets_from_positions``: one host read, as Transformers' own check of
        the positions takes), so that the decoder loop keeps the documents apart with the family's
        document attention, the path the CUDA graphs take for the same batch. Transformers builds a
        mask from the same positions instead; its GPT-OSS (5.25) does not, and lets documents attend
        to each other (docs/transformers_compatibility.md)."""
        if (
            kwargs.get("position_ids") is None
            or kwargs.get(OFFSETS_KEY) is not None
            or not self.takes_document_offsets
            or torch.compiler.is_compiling()  # a host read would break the graph: Transformers' masks
            or not self._is_plain_causal({**kwargs, "position_ids": None})
        ):
            return kwargs
        documents = offsets_from_positions(kwargs["position_ids"])
        if documents is None:
            return kwargs
        offsets_N, longest = documents
        return {**kwargs, OFFSETS_KEY: offsets_N, "max_length_q": longest}

    def _has_document_offsets(self, kwargs: dict) -> bool:
        if kwargs.get(OFFSETS_KEY) is None or not self.takes_document_offsets:
            return False
        position_ids, offsets_N = kwargs["position_ids"], kwargs[OFFSETS_KEY]
        if not isinstance(offsets_N, torch.Tensor) or offsets_N.dim() != 1:
            raise ValueError(f"{OFFSETS_KEY} must be a 1-D tensor of document offsets into the flattened batch")
        if position_ids.dim() != 2:
            raise ValueError(f"with {OFFSETS_KEY}, position_ids must be [batch, seq], got {tuple(position_ids.shape)}")
        return True

    def _is_plain_causal(self, kwargs: dict) -> bool:
        config = self.config
        # Attention dropout sends moetune's GPT-OSS attention to Transformers' forward, which needs the mask.
        dropout = self.training and bool(getattr(config, "attention_dropout", 0.0))
        masks_itself = self.attention_masks_itself and config._attn_implementation == "eager" and not dropout
        return (
            (masks_itself or (config._attn_implementation in _IS_CAUSAL_WITHOUT_MASK
                              and getattr(config, "sliding_window", None) is None))
            and kwargs.get("attention_mask") is None
            and (kwargs.get("position_ids") is None or self._has_document_offsets(kwargs))
            and kwargs.get("cache") is None
            and kwargs.get("past_key_values") is None
            and not kwargs.get("use_cache", getattr(config, "use_cache", False))
            and not kwargs.get("output_hidden_states", getattr(config, "output_hidden_states", False))
            and not kwargs.get("output_attentions", getattr(config, "output_attentions", False))
            and all(hasattr(self, name) for name in (self.embedding_name, "layers", self.final_norm_name))
        )


class MoetuneCausalLMMixin(MoetunePreTrainedMixin):
    """Forward with the fused LM-head loss and the aux loss, and a streaming, shard-aware
    ``save_pretrained``; put it first among the bases."""

    return_logits_in_training: bool = False
    computes_aux_loss: bool = True
    """Whether the loss adds ``router_aux_loss_coef`` x the load-balancing loss when router logits
    are requested (Transformers' Mixtral-style models); DeepSeek-V3 has none (its routers balance
    through the score-correction bias)."""

    def _init_decoder_lm(self, config, pretrained_cls: type, base_model_cls: type) -> None:
        """Transformers' ``XForCausalLM.__init__`` up to ``post_init`` (left to the caller), with
        moetune's base model ``base_model_cls`` under ``model``."""
        pretrained_cls.__init__(self, config)
        self.model = base_model_cls(config)
        self.vocab_size = config.vocab_size
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        # Transformers' parameters in Transformers' order (its 4th, the KV cache, was `past_key_values`
        # before 5.24, which still arrives by keyword): `model(ids, mask, position_ids)` must not
        # take the positions for labels, and Trainer keeps only the dataset columns named here
        # (a `position_ids` column of packed rows would be dropped).
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],  # what Transformers reads to learn which flags it takes
    ) -> MoeCausalLMOutputWithPast | tuple:
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        if return_dict is None:  # Transformers' can_return_tuple: the config's return_dict by default
            return_dict = getattr(self.config, "return_dict", True)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        if return_logits is None:
            no_targets = labels is None and shift_labels is None
            # A tuple output keeps Transformers' positions only with the logits in it (to_tuple drops
            # None fields); a loss function of the user's is computed from the logits, as Transformers does.
            return_logits = (no_targets or not self.training or self.return_logits_in_training or not return_dict
                             or not self._loss_is_transformers_default())  # fmt: skip
        if self.training and use_cache is None and return_dict:
            # No KV cache in training: Transformers only turns packed sequences' position_ids into
            # per-document masks without one, and a cache is dead weight in a training step. A tuple
            # output keeps the config's cache, as Transformers' does, so that its fields keep their places.
            use_cache = False
        elif self.training and use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", False))
        # Only what was given: the backbone reads an absent use_cache as the config's, a None one as off
        # (which would send an evaluation forward down the cache-free plain causal path).
        given = {"position_ids": position_ids, _CACHE_FIELD: cache, "inputs_embeds": inputs_embeds, "use_cache": use_cache}
        kwargs.update({name: value for name, value in given.items() if value is not None})

        if labels is not None or shift_labels is not None:
            kwargs[LABELS_KEY] = ScoredLabels(shift_labels if shift_labels is not None else labels, shift_labels is not None)
        # return_dict=True: the backbone would follow a config's return_dict=False and return a tuple.
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, output_router_logits=output_router_logits,
            return_dict=True, **kwargs,
        )  # fmt: skip
        router_logits = outputs.router_logits if output_router_logits else None
        hidden_BSH = outputs.last_hidden_state

        logits = loss = None
        if return_logits:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_BSH[:, keep, :])
        if labels is not None or shift_labels is not None:
            targets_BS = shift_labels if shift_labels is not None else shift_labels_for_causal_lm(labels)
            if return_logits and logits.shape[1] == targets_BS.shape[1]:
                loss = self.loss_function(
                    logits, labels, self.config.vocab_size, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels
                )
            else:
                loss = lm_head_cross_entropy(
                    self.lm_head,
                    hidden_BSH.reshape(-1, hidden_BSH.shape[-1]),
                    targets_BS.reshape(-1).to(hidden_BSH.device),
                    num_items_in_batch=num_items_in_batch,
                )

        aux_loss = None
        if self.computes_aux_loss and output_router_logits and router_logits:
            token_mask = None
            if attention_mask is not None and attention_mask.dim() == 2:
                # With a KV cache the mask covers past tokens too; the routers saw only the new ones.
                token_mask = attention_mask[:, -hidden_BSH.shape[1] :]
            # The model's attributes, as Transformers reads them (copied from the config at construction).
            aux_loss = load_balancing_loss(
                router_logits,
                num_experts=getattr(self, "num_experts", None) or self.config.num_experts,
                top_k=getattr(self, "num_experts_per_tok", None) or self.config.num_experts_per_tok,
                attention_mask=token_mask,
                group=getattr(self, "aux_loss_group", None),  # global_aux_loss=True: all ranks' tokens
            )
            if loss is not None:
                coefficient = getattr(self, "router_aux_loss_coef", self.config.router_aux_loss_coef)
                loss = loss + coefficient * aux_loss.to(loss.device)

        output = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=router_logits,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD, None)},
        )
        return output if return_dict else output.to_tuple()

    def _loss_is_transformers_default(self) -> bool:
        """Whether ``self.loss_function`` is Transformers' causal-LM cross-entropy, which the fused loss
        computes without the logits; a loss function set on the model (``model.loss_function = f``, a
        subclass's own, another ``loss_type``) is called on the logits instead."""
        if "_loss_function" in self.__dict__ or type(self).loss_function is not PreTrainedModel.loss_function:
            return False
        return getattr(self, "loss_type", None) in (None, "ForCausalLM")


def _transformers_parent(cls: type) -> type:
    """The Transformers class ``cls`` subclasses (the first in its MRO)."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("transformers."))


def _forward_with_signature_of(parent: type):
    """``MoetuneBaseModelMixin._moetune_forward`` as the ``forward`` of a backbone whose Transformers class
    is ``parent``: positional arguments are taken in ``parent.forward``'s order, and its signature and
    annotations are what ``inspect`` reports (``generate`` and Transformers' tests read them to learn
    what a model takes and returns), plus ``output_router_logits`` and ``return_dict``."""
    theirs = inspect.signature(parent.forward)
    parameters = list(theirs.parameters.values())
    positional = [p.name for p in parameters[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = [p for p in parameters if p.kind is p.VAR_KEYWORD]
    named = [p for p in parameters if p.kind is not p.VAR_KEYWORD]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=bool | None)
        for name in ("output_router_logits", "return_dict")
        if name not in theirs.parameters
    ]

    def forward(self, *args, **kwargs):
        if len(args) > len(positional):
            raise TypeError(f"{type(self).__name__}.forward takes {len(positional)} positional arguments, got {len(args)}")
        for name, value in zip(positional, args):  # a plain loop, which torch.compile traces
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}.forward got multiple values for argument {name!r}")
            kwargs[name] = value
        return MoetuneBaseModelMixin._moetune_forward(self, **kwargs)

    forward.__signature__ = theirs.replace(parameters=named + extra + variadic)
    forward.__annotations__ = dict(getattr(parent.forward, "__annotations__", {}))
    forward.__doc__ = parent.forward.__doc__
    forward.__qualname__ = f"{parent.__name__}.forward"
    return forward


def router_logits_recorded_from(parent: type, router_class: type) -> dict:
    """``parent``'s ``_can_record_outputs`` (hidden states, attentions) with ``router_logits`` read from
    moetune's ``router_class`` (the logits are the first field of the ``Routing`` it returns), as
    Transformers declares them for its own routers."""
    return {**(parent._can_record_outputs or {}), "router_logits": OutputRecorder(router_class, index=0)}

