"""The training forward and backward of a moetune decoder stack, replayed from CUDA graphs under
any training loop (Transformers' ``Trainer``, TRL's ``SFTTrainer``, PEFT, a plain PyTorch loop),
transparently to autograd: the loop calls the model and ``loss.backward()`` as always.

Why: an eager moetune step issues ~900 kernels from Python; on an H200 the GPU waits on the host
8-22 ms of a Qwen3-30B-A3B 8-layer step (benchmarks/README.md). A graph replays them with one launch.
``CUDAGraphTrainStep`` does that for a loop moetune owns; this does it for a loop the user owns.

What is captured: the decoder stack (``model.model``: embeddings, layers, final norm) from token
ids to the last hidden states (and the routers' logits when asked), forward in one graph and
backward in another, as ``torch.cuda.make_graphed_callables`` does, inside an autograd Function:
its forward replays the forward graph and returns copies of the outputs, its backward copies the
incoming gradients into the graph's static buffers and replays the backward graph, which writes
the parameters' ``.grad``. The LM head and the loss stay the caller's (moetune's fused loss,
TRL's fused LM head, a user's own), eager.

Shapes: one pair of graphs per shape bucket. The sequence length is padded up to a bucket
(multiples of 256 to 2,048, then 8 buckets per doubling, at most 12.5% padding), so that the
lengths of a variable-length dataset do not capture a graph each. Padding is exact where it is
appended after the real tokens and never attended to by them:
- rows with an ``attention_mask`` (Trainer's and TRL's collators pad per batch) are taken when
  every row is right-padded (checked on the device, read with one host synchronisation per
  forward, which a replayed step can afford): the mask is dropped (causal attention never lets a
  real token see the pads after it), the rows are padded to the bucket with more pads, and the
  outputs are cut back to the batch's length. The padded positions' outputs differ from
  Transformers' (which masks pads from pads too): their labels must be -100, as the collators set
  them; moetune's causal LM checks its own labels, TRL's fused LM head scores labelled positions
  only. The routers' logits of pads are cut away as well, so the aux loss (masked by the caller's
  ``attention_mask``) is unchanged;
- padding-free batches (TRL's ``padding_free``/``packing``: one row, ``position_ids`` and the
  documents' offsets ``cu_seq_lens_q`` / ``max_length_q``, maybe ``seq_idx``) get one more document of pads at the end
  and empty documents up to a bucketed count of offsets; the longest document is bucketed to a
  power of two. A row with ``position_ids`` but no offsets (TRL's packing under SDPA) gets its
  offsets from where the positions restart at 0 (one host synchronisation), when every document's
  positions count up from 0: the documents Transformers' masks find in such positions;
- plain rows (no mask, no positions) are padded to the bucket.
Left-padded rows, other positions, KV caches, ``inputs_embeds``, hidden states or attentions
asked for, evaluation and ``no_grad`` run eagerly as before. Activation checkpointing (TRL's
default) is captured, its recomputation inside the backward graph, unless the layers draw random
numbers (dropout).

Gradients: the backward graph must write ``.grad`` as the training loop expects. Loops set them to
None after each optimizer step (Trainer, ``zero_grad()``) and accumulate across micro-batches. The
first graph ever captured takes the gradients autograd allocates while capturing (its replays
write them; no zeroing); every later forward finds either no gradients (the graph that writes) or
these very tensors (a second graph, captured with them in place, whose backward adds into them).
Buckets captured later write through a copy into the same tensors (one more pass over the
gradients), so that all buckets share one set. Gradients a user set himself (other tensors)
run the micro-batch eagerly. The first forward of each bucket runs eagerly too (lazy
initialisation: Triton compilation, cuBLAS workspaces), as does any forward while an earlier
replay's backward is still pending (its activations live in the graphs' memory).

Streams: a parameter's AccumulateGrad node remembers the stream it was created on, and a capture
whose backward meets one created on the default stream is invalidated. Such a node lives as long
as any autograd graph through it, and a plain loop keeps its last ``loss`` (and so its graph) alive
into the next forward. So the eager runs of the padded batches are islands (``_Island``: their
graph is dropped once their backward ran), the caller's own eager forwards are tracked until their
graph is gone, and a capture waits (the batch runs as an island) while one is alive.

Requirements (checked, else eager): CUDA, a single device, no hooks on the parameters' gradients
(a replay would not call them), one process (DDP's and DeepSpeed's all-reduce starts from such
hooks; moetune's multi-GPU path is ``ep_size`` with FSDP2), no expert parallelism (FSDP2 and the
all-to-all need the host), untied embeddings (a tied LM head would add to the embedding's gradient
outside the graphs first), no host synchronisation inside the layers (moetune's one-device MoE
path has none). Parameters that move or change ``requires_grad`` (``model.to``, PEFT) drop the
graphs and start over. Off with ``MoetuneOptions(cuda_graphs=False)`` or
``moetune.training.set_training_graphs(model, False)``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetune.layers.document_attention import offsets_from_positions

# Keyword arguments of the decoder stack's forward that the graphs take (the rest: eager).
_GRAPHABLE_KEYS = frozenset({
    "input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "seq_idx", "use_cache", "return_dict",
})  # fmt: skip
# Keys that may be present with a value that changes nothing here.
_NEUTRAL_FALSY = ("cache", "past_key_values", "inputs_embeds", "output_attentions", "output_hidden_states")


LABELS_KEY = "moetune_scored_labels"
"""Keyword under which moetune's causal LM hands its targets to its decoder stack (popped there)."""


class ScoredLabels(NamedTuple):
    """The causal LM's targets: positions whose prediction is scored are those not -100 (``shifted``:
    already aligned with the outputs, Transformers' ``shift_labels``; else one position later)."""

    labels: torch.Tensor
    shifted: bool


def bucket_length(length: int) -> int:
    """``length`` rounded up: a multiple of 256 up to 2,048, above that of 1/16 of the next power of
    two (8 buckets per doubling, at most 12.5% padding)."""
    if length <= 2048:
        return max(256, -(-length // 256) * 256)
    step = 1 << ((length - 1).bit_length() - 4)
    return -(-length // step) * step


def bucket_count(count: int, *, minimum: int = 8) -> int:
    """``count`` rounded up to a power of two (at least ``minimum``)."""
    return max(minimum, 1 << max(0, count - 1).bit_length())


@dataclass
class BatchPlan:
    """A batch as the graphs take it: the padded inputs of the plain causal path and how to cut the
    outputs back (``rows`` x ``length`` real positions of ``rows`` x ``padded`` computed)."""

    key: tuple
    tensors: dict[str, torch.Tensor]
    constants: dict[str, Any]
    rows: int
    length: int
    padded: int

    def cut_hidden(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return hidden_BSH if self.padded == self.length else hidden_BSH[:, : self.length]

    def cut_router_logits(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.padded == self.length:
            return logits_TE
        return logits_TE.view(self.rows, self.padded, -1)[:, : self.length].reshape(self.rows * self.length, -1)


def plan_batch(kwargs: dict[str, Any], *, pad_token_id: int = 0, labels: ScoredLabels | None = None) -> BatchPlan | None:
    """The plain-causal, bucket-padded form of a decoder-stack call, or None when padding would not
    be exact (or the call has inputs the graphs do not take). May read the attention mask (and
    ``labels``: no padded position's prediction may be scored) on the host (one synchronisation)."""
    if any(key not in _GRAPHABLE_KEYS and key not in _NEUTRAL_FALSY for key in kwargs):
        return None
    if any(kwargs.get(key) is not None and kwargs.get(key) is not False for key in (*_NEUTRAL_FALSY, "use_cache")):
        return None
    ids_BS = kwargs.get("input_ids")
    if not isinstance(ids_BS, torch.Tensor) or ids_BS.dim() != 2 or ids_BS.dtype not in (torch.int64, torch.int32):
        return None
    rows, length = ids_BS.shape
    if kwargs.get("cu_seq_lens_q") is not None:
        return _plan_documents(kwargs, ids_BS, pad_token_id=pad_token_id)
    if kwargs.get("position_ids") is not None or kwargs.get("seq_idx") is not None:
        # Positions without offsets (TRL's packing under SDPA): the documents restart at position 0.
        documents = _documents_from_positions(kwargs, ids_BS)
        return None if documents is None else _plan_documents(documents, ids_BS, pad_token_id=pad_token_id)
    mask_BS = kwargs.get("attention_mask")
    if mask_BS is not None and not _right_padded(mask_BS, rows=rows, length=length, labels=labels):
        return None
    padded = bucket_length(length)
    return BatchPlan(
        key=("rows", rows, padded), tensors={"input_ids": F.pad(ids_BS, (0, padded - length), value=pad_token_id)},
        constants={}, rows=rows, length=length, padded=padded,
    )  # fmt: skip


def _right_padded(mask_BS: torch.Tensor, *, rows: int, length: int, labels: ScoredLabels | None) -> bool:
    """Every row's real tokens first, then pads only, and no prediction made at a pad scored."""
    if not isinstance(mask_BS, torch.Tensor) or mask_BS.shape != (rows, length) or mask_BS.is_floating_point():
        return False  # a 4-D or float mask is someone's own attention pattern
    real_BS = mask_BS != 0
    lengths_B1 = real_BS.sum(-1, keepdim=True)
    positions_S = torch.arange(length, device=mask_BS.device)
    exact = (real_BS == (positions_S < lengths_B1)).all()
    if labels is not None:
        targets_BS = labels.labels.to(mask_BS.device)
        if targets_BS.shape != (rows, length):
            return False
        # The prediction at pad position j >= length_b is scored by target j (shifted) or j + 1.
        first_unscored_B1 = lengths_B1 if labels.shifted else lengths_B1 + 1
        exact = exact & ~((targets_BS != -100) & (positions_S >= first_unscored_B1)).any()
    return bool(exact)


def _documents_from_positions(kwargs: dict[str, Any], ids_BS: torch.Tensor) -> dict[str, Any] | None:
    """``kwargs`` with the documents' offsets of a padding-free row that has ``position_ids`` only
    (``offsets_from_positions``), or None."""
    if ids_BS.shape[0] != 1 or kwargs.get("attention_mask") is not None or kwargs.get("seq_idx") is not None:
        return None
    positions_BS = kwargs.get("position_ids")
    if not isinstance(positions_BS, torch.Tensor) or tuple(positions_BS.shape) != tuple(ids_BS.shape):
        return None
    documents = offsets_from_positions(positions_BS)
    if documents is None:
        return None
    offsets_N, longest = documents
    return {**kwargs, "cu_seq_lens_q": offsets_N, "max_length_q": longest}


def _plan_documents(kwargs: dict[str, Any], ids_BS: torch.Tensor, *, pad_token_id: int) -> BatchPlan | None:
    """Padding-free batches: one row of documents; one more document of pads, empty ones after it."""
    offsets_N, positions_BS = kwargs["cu_seq_lens_q"], kwargs.get("position_ids")
    rows, length = ids_BS.shape
    if rows != 1 or not isinstance(offsets_N, torch.Tensor) or offsets_N.dim() != 1 or positions_BS is None:
        return None
    if not _same_offsets(kwargs.get("cu_seq_lens_k"), offsets_N):
        return None  # different key documents: not a causal self-attention over packed documents
    if kwargs.get("attention_mask") is not None or tuple(positions_BS.shape) != (1, length):
        return None
    max_length = kwargs.get("max_length_q")
    max_length = length if max_length is None else int(max_length)
    padded = bucket_length(length)
    num_offsets = bucket_count(offsets_N.numel() + 1)
    longest = min(padded, bucket_count(max(max_length, padded - length, 1), minimum=128))
    device = ids_BS.device
    offsets = offsets_N.to(device=device, dtype=torch.int32)
    tail = torch.full((num_offsets - offsets.numel(),), padded, dtype=torch.int32, device=device)
    pad_positions = torch.arange(padded - length, device=device, dtype=positions_BS.dtype).unsqueeze(0)
    tensors = {
        "input_ids": F.pad(ids_BS, (0, padded - length), value=pad_token_id),
        "position_ids": torch.cat([positions_BS, pad_positions], dim=1),
        "cu_seq_lens_q": torch.cat([offsets, tail]),
    }
    documents_BS = kwargs.get("seq_idx")  # TRL's document number per token (Mamba-2 layers read it)
    if documents_BS is not None:
        if tuple(documents_BS.shape) != (1, length):
            return None
        pad_documents = (documents_BS[:, -1:] + 1).expand(1, padded - length)
        tensors["seq_idx"] = torch.cat([documents_BS, pad_documents], dim=1)
    return BatchPlan(
        key=("documents", padded, num_offsets, longest), tensors=tensors, constants={"max_length_q": longest},
        rows=1, length=length, padded=padded,
    )  # fmt: skip


def _same_offsets(keys_N: torch.Tensor | None, queries_N: torch.Tensor) -> bool:
    """Whether the key documents can be taken as the query documents: absent, the same tensor, or one
    of the same shape (a Trainer moves each input to the GPU on its own, so TRL's one tensor arrives
    as two). Their values are not read (no host synchronisation): moetune's document attention reads
    the query offsets only, on the eager path as here (causal self-attention over packed documents)."""
    if keys_N is None or keys_N is queries_N:
        return True
    return isinstance(keys_N, torch.Tensor) and keys_N.shape == queries_N.shape


class _GraphToken:
    """Stands for one autograd graph through the stack's parameters: alive while that graph is (held by
    its Function's context, or kept in its nodes' metadata), ``done`` once its backward ran. An
    island's token also holds its inner graph's outputs until then."""

    done = False
    outputs: list[torch.Tensor] | None = None


@dataclass
class _Graphs:
    """One bucket's forward and backward graphs for one gradient state ("write" or "accumulate")."""

    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    outputs: list[torch.Tensor]
    grad_outputs: list[torch.Tensor]
    grads_before: str


@dataclass
class _Bucket:
    inputs: dict[str, torch.Tensor]
    eager_runs: int = 0
    graphs: dict[str, _Graphs] = field(default_factory=dict)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: TrainingGraphs, graphs: _Graphs, pending: _GraphToken, _token: torch.Tensor):
        graphs.forward.replay()
        ctx.runner, ctx.graphs, ctx.pending = runner, graphs, pending
        # Copies: the next replay overwrites the static outputs, and the caller may keep these.
        return tuple(output.clone() for output in graphs.outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        if ctx.pending.done:  # a replay writes the gradients: a second backward would not add to them
            raise RuntimeError(_SECOND_BACKWARD)
        ctx.runner._replay_backward(ctx.graphs, grads)
        ctx.pending.done = True
        return None, None, None, None


_SECOND_BACKWARD = (
    "moetune: a second backward through one forward of the decoder stack (retain_graph=True) is not supported "
    "on its CUDA-graph path; switch it off with moetune.training.set_training_graphs(model, False)"
)


class _Island(torch.autograd.Function):
    """An eager forward of the stack, opaque to the caller's autograd graph: its backward runs the inner
    graph's backward and drops that graph. Why: the parameters' AccumulateGrad nodes remember the
    stream they were created on; one that outlives its step (the caller's ``loss`` of the last step
    keeps its whole graph alive until the next assignment) makes a later capture's backward wait on
    that (default) stream, which invalidates the capture. An island's nodes die with its backward."""

    @staticmethod
    def forward(ctx, token: _GraphToken, _token: torch.Tensor):
        ctx.token = token
        return tuple(output.detach() for output in token.outputs)

    @staticmethod
    def backward(ctx, *grads):
        token = ctx.token
        if token.done:
            raise RuntimeError(_SECOND_BACKWARD)
        outputs, token.outputs = token.outputs, None
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        token.done = True
        return None, None


class TrainingGraphs:
    """CUDA-graph replays of one decoder stack's training forward and backward (see the module).
    ``run`` returns the stack's outputs, or None when this call must run eagerly."""

    graph_accumulation: bool = True
    """Replay a second graph that adds into the gradients of an earlier micro-batch (gradient
    accumulation; its GPU test in tests/test_graphed_training.py). Off: such micro-batches run
    eagerly and add into the same gradients, which is exact too."""

    graph_checkpointing: bool = True
    """Capture activation checkpointing's recomputation inside the backward graph (its GPU test in
    tests/test_graphed_training.py). Off: models with checkpointing on train eagerly."""

    def __init__(self, backbone: torch.nn.Module, *, eager_runs_per_bucket: int = 1, use_graphs: bool = True) -> None:
        """``use_graphs=False`` runs the bucket-padded batches eagerly (on any device): the padding's
        exactness, testable without a GPU."""
        self._backbone_ref = weakref.ref(backbone)
        self.eager_runs_per_bucket = eager_runs_per_bucket
        self.use_graphs = use_graphs
        self.disabled_reason: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._signature: tuple | None = None
        self._params: list[torch.nn.Parameter] = []
        self._experts: list[torch.nn.Module] = []  # the stack's grouped experts (_experts_read_counts_on_the_host)
        self._grads: list[torch.Tensor | None] | None = None  # the shared .grad tensors, once captured
        self._adopted = False  # whether they are a loop's own (see _grad_state)
        self._buckets: dict[tuple, _Bucket] = {}
        self._pool = None
        self._pending: weakref.ref | None = None
        self._token: torch.Tensor | None = None
        # _GraphToken tokens of eager graphs that may still be alive (kept over a reset: the graphs are)
        self._eager_graphs: list[weakref.ref] = getattr(self, "_eager_graphs", [])
        self.replays = 0  # forwards replayed (for tests and benchmarks)
        self.eager_reason: str | None = None  # why the last forward did not take the graphs' path

    def __deepcopy__(self, memo):  # graphs are not copied with a model: the copy starts over
        return _fresh(self)

    def __getstate__(self):
        return {"eager_runs_per_bucket": self.eager_runs_per_bucket, "use_graphs": self.use_graphs}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._backbone_ref = lambda: None
        self.disabled_reason = None
        self._reset()

    # -- the entry point --

    def run(self, kwargs: dict[str, Any], *, output_router_logits: bool, forward: Callable,
            labels: ScoredLabels | None = None) -> Any | None:
        """The stack's outputs for ``kwargs`` from the graphs (or from an eager run of the padded
        batch while its bucket warms up); None to let the caller run its own eager path.
        ``forward(kwargs, output_router_logits)`` runs the stack eagerly on plain causal inputs."""
        backbone = self._backbone_ref()
        if backbone is None or self.disabled_reason is not None or not _graphable_now(backbone):
            return self._eager("not a training forward on CUDA (or graphs disabled)")
        if _several_processes():
            return self._eager("a run of several processes (DDP's gradient hooks need autograd's own backward)")
        if _checkpointing(backbone) and not self.graph_checkpointing:
            return self._eager("activation checkpointing (graph_checkpointing is off)")
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or (self.use_graphs and not ids.is_cuda):
            return self._eager("no CUDA input_ids")
        if not self._check_parameters(backbone, ids.device):
            return self._eager("parameters sharded, spread over devices, tied or frozen")
        if any(p._post_accumulate_grad_hooks or p._backward_hooks for p in self._params):
            # An optimizer in the backward, a gradient hook: a replayed backward would not call them.
            return self._eager("hooks on the parameters' gradients")
        pending = self._pending() if self._pending is not None else None
        if pending is not None and not pending.done:
            return self._eager("an earlier replay's backward is pending")  # its activations live in the graphs
        plan = plan_batch(kwargs, pad_token_id=_pad_token_id(backbone), labels=labels)
        if plan is None:
            return self._eager(f"padding would not be exact for inputs {sorted(k for k, v in kwargs.items() if v is not None)}")
        # use_cache=False: a training step keeps no KV cache (the causal LM says so; an absent key
        # would read the config's use_cache, on in most Hub configs).
        call = {**plan.tensors, **plan.constants, "use_cache": False, "return_dict": True}
        if not backbone._is_plain_causal(call):
            return self._eager(f"not a plain causal batch for attention {backbone.config._attn_implementation!r}")
        self.eager_reason = None
        if not self.use_graphs:
            return self._island(call, plan, output_router_logits, forward)
        if _experts_read_counts_on_the_host(self._experts):
            return self._eager("experts run their per-expert loop (weights not bf16, or the loop backend): it reads "
                               "the token counts on the host, which a CUDA-graph capture cannot")
        state = self._grad_state(adopt=True)
        if state == "accumulate" and not self.graph_accumulation:
            self.eager_reason = "a further micro-batch of gradient accumulation (graph_accumulation is off)"
            return self._island(call, plan, output_router_logits, forward)
        key = (*plan.key, output_router_logits, *_autocast_state())
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(inputs={name: torch.empty_like(t) for name, t in plan.tensors.items()})
        graphs = bucket.graphs.get(state)
        warming_up = state is None or bucket.eager_runs < self.eager_runs_per_bucket
        # An eager graph of the parameters that outlives its step (see _Island) postpones a capture.
        if warming_up or (graphs is None and self.eager_graph_alive()):
            if warming_up:
                bucket.eager_runs += 1
            else:
                self.eager_reason = "an eager step's autograd graph is still alive (capture postponed)"
            if state == "write" and self._grads is not None:
                self._adopt_shared_grads(zero=True)  # the eager backward then adds into them: no second set
            return self._island(call, plan, output_router_logits, forward)
        for name, tensor in plan.tensors.items():
            bucket.inputs[name].copy_(tensor)
        if graphs is None:
            try:
                graphs = bucket.graphs[state] = self._capture(bucket, plan, state, output_router_logits, forward)
            except Exception as error:  # noqa: BLE001 -- any capture failure: train eagerly from now on
                self._disable(f"capturing the training step failed ({type(error).__name__}: {error})")
                outputs = forward(call, output_router_logits)
                return _cut(outputs, plan)
        pending = _GraphToken()
        self._pending = weakref.ref(pending)
        self.replays += 1
        tensors = _Replay.apply(self, graphs, pending, self._token)
        return _cut(_as_outputs(tensors, output_router_logits), plan)

    # Under torch.compile the stack runs here, not traced (a graph break; torch._dynamo is imported on
    # the first call only, so importing moetune does not load it).
    run = torch._disable_dynamo(run)

    def _island(self, call: dict[str, Any], plan: BatchPlan, output_router_logits: bool, forward: Callable):
        """The padded batch run eagerly, inside an ``_Island``."""
        outputs = forward(call, output_router_logits)
        tensors = _flatten(outputs, output_router_logits)
        if self._token is None or not any(t.requires_grad for t in tensors):
            return _cut(outputs, plan)
        token = _GraphToken()
        token.outputs = tensors
        self._remember(token)
        return _cut(_as_outputs(_Island.apply(token, self._token), output_router_logits), plan)

    def track_eager(self, outputs) -> None:
        """Note the caller's eager forward of the stack (``run`` returned None): its autograd graph holds
        the parameters' AccumulateGrad nodes for as long as it lives, and no capture starts meanwhile."""
        token = None
        for output in _flatten(outputs, outputs.get("router_logits") is not None):
            if output.grad_fn is not None:
                token = token or _GraphToken()
                output.grad_fn.metadata["moetune_eager_graph"] = token
        if token is not None:
            self._remember(token)

    # Reads autograd nodes, which a traced (torch.compile) forward does not have: run outside dynamo.
    track_eager = torch._disable_dynamo(track_eager)

    def eager_graph_alive(self) -> bool:
        """Whether an eager graph through the parameters (the caller's, or an island's before its
        backward) is still alive."""
        self._eager_graphs = [ref for ref in self._eager_graphs if (token := ref()) is not None and not token.done]
        return bool(self._eager_graphs)

    def _remember(self, token: _GraphToken) -> None:
        self.eager_graph_alive()  # drops the tokens of graphs gone since: the list stays short
        self._eager_graphs.append(weakref.ref(token))

    def _eager(self, reason: str) -> None:
        """Record why this forward runs eagerly (``eager_reason``: what a user or benchmark checks when
        no replays happen) and let the caller run its own path."""
        self.eager_reason = reason
        return None

    # -- parameters and gradients --

    def _check_parameters(self, backbone: torch.nn.Module, device: torch.device) -> bool:
        params = list(backbone.parameters())
        signature = tuple((id(p), p.data_ptr(), p.requires_grad) for p in params)
        if signature == self._signature:
            return bool(self._params)
        self._release()
        self._signature = signature
        if any(type(p).__name__ == "DTensor" or p.device != device for p in params) or _tied_embeddings(backbone):
            # Sharded or spread over devices: eager. Tied embeddings: the LM head (eager, outside) adds
            # to the embedding's gradient before the stack's backward runs.
            self._params = []
            return False
        self._params = [p for p in params if p.requires_grad]
        from moetune.moe.experts import GroupedExperts

        self._experts = [m for m in backbone.modules() if isinstance(m, GroupedExperts)]
        self._token = torch.zeros((), device=device, requires_grad=True) if self._params else None
        return bool(self._params)

    def _release(self) -> None:
        signature_reset = self._signature is not None
        self._reset()
        if signature_reset and torch.cuda.is_available():
            torch.cuda.synchronize()  # the old graphs' memory may still be in use by queued work

    def _grad_state(self, *, adopt: bool = False) -> str | None:
        """"write" (no gradients), "accumulate" (the shared ones), None (someone else's: eager).

        ``adopt``: gradients a loop keeps from step to step (``zero_grad(set_to_none=False)``) become the
        shared ones where none exist yet; should a later forward find no gradients after all (they were
        an accumulation's first micro-batch, set to None after the step), the graphs are captured again
        around gradients of their own (``_start_over``)."""
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            if self._adopted and adopt:
                self._start_over()
            return "write"
        if self._grads is not None and all(g is shared for g, shared in zip(grads, self._grads)):
            return "accumulate"
        if adopt and self._grads is None and all(g is not None and g.shape == p.shape for g, p in zip(grads, self._params)):
            self._grads, self._adopted = grads, True
            return "accumulate"
        return None

    def _start_over(self) -> None:
        """Drop every graph and the shared gradients (the buckets stay warm)."""
        torch.cuda.synchronize()  # replays still queued use the pool about to be freed
        for bucket in self._buckets.values():
            bucket.graphs.clear()
        self._grads, self._adopted, self._pool = None, False, None

    def _adopt_shared_grads(self, *, zero: bool) -> None:
        shared = [g for g in self._grads if g is not None]
        if zero and shared:
            torch._foreach_zero_(shared)
        for param, grad in zip(self._params, self._grads):
            param.grad = grad

    def _disable(self, reason: str) -> None:
        import warnings

        warnings.warn(f"moetune: {reason}; this model trains eagerly from now on", stacklevel=3)
        self._reset()
        self.disabled_reason = reason

    # -- capture and replay --

    def _capture(self, bucket: _Bucket, plan: BatchPlan, state: str, output_router_logits: bool, forward: Callable) -> _Graphs:
        call = {**bucket.inputs, **plan.constants, "use_cache": False, "return_dict": True}
        saved = [p.grad for p in self._params]
        copies: list = []
        if state == "accumulate":
            self._adopt_shared_grads(zero=False)
        else:
            for param in self._params:
                param.grad = None
            if self._grads is not None:  # a later bucket: write through a copy into the shared gradients
                copies = [param.register_post_accumulate_grad_hook(_copy_into(grad))
                          for param, grad in zip(self._params, self._grads) if grad is not None]  # fmt: skip
        try:
            torch.cuda.synchronize()
            forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            backbone = self._backbone_ref()
            with _checkpointing_without_rng_state(backbone):
                with _fresh_autocast_cache(), torch.cuda.graph(forward_graph, pool=self._pool):
                    outputs = _flatten(forward(call, output_router_logits), output_router_logits)
                if self._pool is None:
                    self._pool = forward_graph.pool()
                grad_outputs = [torch.zeros_like(output) for output in outputs]
                differentiable = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
                if not differentiable:
                    raise RuntimeError("the captured forward produced no output that requires a gradient")
                with torch.cuda.graph(backward_graph, pool=self._pool):
                    torch.autograd.backward([o for o, _ in differentiable], [g for _, g in differentiable])
            outputs = [output.detach() for output in outputs]
            if state == "write" and self._grads is None:  # the first graph: its gradients become the shared ones
                self._grads = [p.grad for p in self._params]
            elif state == "accumulate":
                replaced = [i for i, (p, g) in enumerate(zip(self._params, self._grads)) if p.grad is not g]
                if replaced:
                    raise RuntimeError(f"the accumulating backward replaced {len(replaced)} gradients instead of adding to them")
        finally:
            for handle in copies:
                handle.remove()
            for param, grad in zip(self._params, saved):
                param.grad = grad
        return _Graphs(forward_graph, backward_graph, outputs, grad_outputs, grads_before=state)

    def _replay_backward(self, graphs: _Graphs, grads: tuple) -> None:
        """The backward graph; when other gradients arrived since the forward (an eager forward's
        backward ran first: two forwards, one backward), a writing graph's gradients are added to them."""
        changed = self._grad_state() != graphs.grads_before
        aliased = any(p.grad is g for p, g in zip(self._params, self._grads or ()) if g is not None)
        if changed and (graphs.grads_before != "write" or aliased):
            raise RuntimeError(
                "moetune: the gradients changed between a CUDA-graph replayed forward and its backward (set to None "
                "or replaced in between); train this model with MoetuneOptions(cuda_graphs=False)"
            )
        for static, grad in zip(graphs.grad_outputs, grads):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        graphs.backward.replay()
        if not changed:
            self._adopt_shared_grads(zero=False)
            return
        for param, grad in zip(self._params, self._grads):
            if grad is not None:
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)


def _copy_into(target: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        target.copy_(param.grad)
        param.grad = None  # its memory goes back to the graph's pool for the rest of the backward

    return hook


def _fresh(runner: TrainingGraphs) -> TrainingGraphs:
    copy = TrainingGraphs.__new__(TrainingGraphs)
    copy.__setstate__(runner.__getstate__())
    return copy


def _graphable_now(backbone: torch.nn.Module) -> bool:
    if not (backbone.training and torch.is_grad_enabled()):
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # someone else's capture (CUDAGraphTrainStep) records the eager stack
    # Activation checkpointing (TRL's default) is captured with its recomputation (see
    # _checkpointing_without_rng_state), which is exact only where the layers draw no random numbers.
    return not (_checkpointing(backbone) and _draws_random_numbers(backbone))


def _experts_read_counts_on_the_host(experts: list[torch.nn.Module]) -> bool:
    """Whether some experts run their per-expert loop, which sizes its splits from token counts read
    on the host (``moetune.moe.experts.run_experts``): the ``loop`` backend, or ``auto`` where torch's
    grouped GEMM does not run on the rows (in autocast's dtype where it is on: weights other than bf16
    outside bf16 autocast, a GPU before sm80). A capture of such a stack would fail; it trains eagerly
    instead, without trying."""
    from moetune.kernels.grouped_gemm import grouped_mm_runs
    from moetune.utils.autocast import cuda_autocast_dtype

    def loops(m) -> bool:
        if m.fp8 is not None or m.backend not in ("auto", "loop"):
            return False
        weight = m.in_proj
        return m.backend == "loop" or not grouped_mm_runs(weight.device, cuda_autocast_dtype(weight) or weight.dtype)

    return any(loops(m) for m in experts)


def _several_processes() -> bool:
    """A data-parallel run (DDP, DeepSpeed, accelerate's multi-GPU): their hooks on the parameters'
    AccumulateGrad nodes start the gradients' all-reduce; a replayed backward would skip them."""
    distributed = torch.distributed
    return distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1


def _checkpointing(backbone: torch.nn.Module) -> bool:
    return any(getattr(module, "gradient_checkpointing", False) for module in backbone.modules())


def _draws_random_numbers(backbone: torch.nn.Module) -> bool:
    dropout = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in backbone.modules())
    return dropout or float(getattr(backbone.config, "attention_dropout", 0.0) or 0.0) > 0


@contextlib.contextmanager
def _checkpointing_without_rng_state(backbone: torch.nn.Module):
    """Transformers' activation checkpointing saves and restores the CUDA random-number state around
    each recomputation, which cannot be read inside a graph capture; the layers draw none
    (``_draws_random_numbers``), so the capture checkpoints with ``preserve_rng_state=False``: the same
    recomputation. Other checkpointing functions (offloading wrappers) are left as they are (a capture
    that reads the state fails, and the model then trains eagerly)."""
    from torch.utils.checkpoint import checkpoint

    swapped = []
    for module in backbone.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, functools.partial) and func.func is checkpoint:
            swapped.append((module, func))
            module._gradient_checkpointing_func = functools.partial(checkpoint, *func.args, **{**func.keywords, "preserve_rng_state": False})
    try:
        yield
    finally:
        for module, func in swapped:
            module._gradient_checkpointing_func = func


def _tied_embeddings(backbone: torch.nn.Module) -> bool:
    config = backbone.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _pad_token_id(backbone: torch.nn.Module) -> int:
    pad = getattr(backbone.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < backbone.config.vocab_size else 0


def _autocast_state() -> tuple:
    if not torch.is_autocast_enabled("cuda"):
        return (False,)
    return (True, torch.get_autocast_dtype("cuda"))


@contextlib.contextmanager
def _fresh_autocast_cache():
    """Autocast's cache of cast weights must neither reach into a capture (a cast made before it would be
    replayed stale) nor outlive it (a cast made inside lives in the graph's memory): emptied on both
    sides. Not by switching the cache off, as make_graphed_callables does: that is part of the global
    state torch.compile guards on, so compiled regions in the layers (Nemotron-H's Mamba-2 scan) would
    recompile inside the capture, which invalidates it."""
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


def _flatten(outputs, output_router_logits: bool) -> list[torch.Tensor]:
    tensors = [outputs.last_hidden_state]
    if output_router_logits:
        tensors.extend(outputs.router_logits)
    return tensors


def _as_outputs(tensors: tuple[torch.Tensor, ...], output_router_logits: bool):
    from transformers.modeling_outputs import MoeModelOutputWithPast

    outputs = MoeModelOutputWithPast(last_hidden_state=tensors[0])
    if output_router_logits:
        outputs["router_logits"] = tuple(tensors[1:])
    return outputs


def _cut(outputs, plan: BatchPlan):
    outputs["last_hidden_state"] = plan.cut_hidden(outputs.last_hidden_state)
    if outputs.get("router_logits") is not None:
        outputs["router_logits"] = tuple(plan.cut_router_logits(logits) for logits in outputs.router_logits)
    return outputs


def training_graphs(backbone: torch.nn.Module) -> TrainingGraphs | None:
    """The backbone's graphs (created on first use), or None when they are switched off or cannot apply."""
    if not getattr(backbone, "cuda_graph_training", False):
        return None
    runner = backbone.__dict__.get("_training_graphs")
    if runner is None:
        if not torch.cuda.is_available():
            return None
        runner = TrainingGraphs(backbone)
        backbone.__dict__["_training_graphs"] = runner  # not a submodule: no state dict entry, no .to()
    return runner


def set_training_graphs(model: torch.nn.Module, enabled: bool) -> None:
    """Switch the CUDA-graph training forward / backward of every moetune decoder stack in ``model``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_training_graphs: enabled must be True or False, got {enabled!r}")
    for module in model.modules():
        if hasattr(type(module), "cuda_graph_training"):
            module.cuda_graph_training = enabled
            module.__dict__.pop("_training_graphs", None)
