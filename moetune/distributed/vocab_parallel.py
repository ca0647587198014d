"""``vocab_parallel=True`` (with ``dense_parallel="replicate"``): the input embedding and the LM head
are split by vocabulary rows over all ranks, Megatron-LM's vocabulary parallelism, instead of
being replicated.

Why: they are most of the replicated parameters (622M of Qwen3-30B-A3B's 0.93B non-expert ones).
Replicated, every rank stores them with their gradients and AdamW states (8 bytes per parameter in
bf16), runs AdamW over all of them (14 bytes per parameter of memory traffic, the same work on
every rank) and all-reduces the LM head's dense gradient (622 MB per step, beside the backward's
kernels). Split, each rank holds, updates and keeps states for 1 / world of them, and the only
traffic is the step's tokens: hidden states and their gradients, 16 MB per rank at 4096 tokens x
2048 in bf16.

How (rank r holds rows [r * ceil(V / world), ...) of both matrices: a DTensor ``Shard(0)`` over the
flattened world mesh, so saving, loading, DCP and gradient clipping treat it like any shard):
- Embedding: all-gather every rank's token ids; look up the ids this rank holds (zero rows for the
  others); reduce-scatter, so each token gets its row from the one rank that holds it (a sum with
  zeros: exact). Backward: all-gather the output gradients and accumulate the held rows' ones,
  divided by world: the average over the ranks, like the replicated gradients.
- Loss: all-gather the final hidden states, targets and loss normalisers; then chunk by chunk the
  logits of this rank's vocabulary for every rank's tokens, each row's log-sum-exp and target logit
  over the shard, an all-gather of those two floats per row, and the shard's logits gradient
  (``moetune.kernels.cross_entropy``). The head shard's gradient is then complete on its rank (it
  saw every rank's tokens); the hidden states' gradient is a partial sum per shard, reduce-scattered
  back to the tokens' ranks. The FLOPs per rank are the replicated head's.
- Logits (evaluation, generation, ``return_logits``): the shard's logits of every rank's tokens,
  then an all-to-all so that each rank gets every shard's columns of its own tokens.

Every rank must run the same forwards and backwards (as the expert-parallel dispatcher needs
anyway). The head's gradient is computed in the forward (as the replicated fused loss does), so the
loss's incoming gradient is assumed equal on every rank (plain ``loss.backward()``, or a loss scale
or accumulation divisor that every rank applies alike).

Shape legend: T tokens on this rank, G = world * T gathered tokens, H hidden, V vocabulary, S rows
of this rank's shard, C rows in one chunk of the loss.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moetune.distributed.collectives import gather_rows, pad_rows, scatter_sum_rows
from moetune.distributed.token_counts import LargestTokenCount
from moetune.kernels.cross_entropy import cross_entropy_shard_grad_, cross_entropy_shard_stats
from moetune.layers.linear_cross_entropy import (
    IGNORE_INDEX,
    accumulate_head_grad,
    as_dtypes,
    gemm_operands,
    loss_normalizer,
    saved_gradients_scaled,
)


class VocabShard:
    """Which rows of a vocabulary-sized matrix this rank holds, and the group they are split over."""

    def __init__(self, group: dist.ProcessGroup, vocab_size: int, *, what: str) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.vocab_size = vocab_size
        self.max_rows = math.ceil(vocab_size / self.world)  # DTensor's Shard(0) split (torch.chunk's)
        self.sizes = [max(0, min(vocab_size, (r + 1) * self.max_rows) - r * self.max_rows) for r in range(self.world)]
        if min(self.sizes) == 0:
            raise ValueError(
                f"vocab_parallel: a vocabulary of {vocab_size} rows leaves some of {self.world} ranks without a row "
                f"(ceil({vocab_size} / {self.world}) rows each); use vocab_parallel=False"
            )
        self.start = self.rank * self.max_rows
        self.rows = self.sizes[self.rank]
        self.token_counts = LargestTokenCount(group, what=f"vocab_parallel ({what})")


def check_vocab_parallel(model: nn.Module) -> None:
    """A clear error before sharding when the model's embedding or head is not the plain kind."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    plain_embedding = (
        isinstance(embedding, nn.Embedding) and type(embedding).forward is nn.Embedding.forward
        and embedding.max_norm is None and not embedding.sparse and not embedding.scale_grad_by_freq
    )  # fmt: skip
    if not plain_embedding:
        raise ValueError(
            f"vocab_parallel needs a plain nn.Embedding input embedding, got {type(embedding).__name__}; use vocab_parallel=False"
        )
    if not (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and head.bias is None):
        raise ValueError(
            f"vocab_parallel needs a bias-free nn.Linear LM head, got {type(head).__name__}; use vocab_parallel=False"
        )


def shard_vocabulary(model: nn.Module, world_mesh) -> None:
    """Make the input embedding's and the LM head's weights (one tensor when tied) DTensors
    ``Shard(0)`` over ``world_mesh`` and give both modules their vocabulary-parallel forwards. On the
    meta device, before allocation (as ``apply_expert_parallel``)."""
    check_vocab_parallel(model)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embedding.weight
    sharded_of: dict[int, nn.Parameter] = {}
    for module, what in ((embedding, "the input embedding"), (head, "the LM head")):
        weight = module.weight
        shard = VocabShard(world_mesh.get_group(), weight.shape[0], what=what)  # raises if a rank gets no row
        if id(weight) not in sharded_of:
            local = torch.empty((shard.rows, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
            sharded = DTensor.from_local(local, world_mesh, [Shard(0)], run_check=False, shape=weight.shape,
                                         stride=weight.stride())  # fmt: skip
            sharded_of[id(weight)] = nn.Parameter(sharded, requires_grad=weight.requires_grad)
        module.weight = sharded_of[id(weight)]
        module._vocab_shard = shard
        module.__class__ = _vocab_parallel_class(type(module), VocabParallelEmbedding if module is embedding else VocabParallelLMHead)
    assert not tied or head.weight is embedding.weight


_classes: dict[tuple[type, type], type] = {}


def _vocab_parallel_class(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin``'s forward (FSDP2's pattern: the module and its state dict stay as they are)."""
    if issubclass(cls, mixin):
        return cls
    if (cls, mixin) not in _classes:
        _classes[(cls, mixin)] = type(f"VocabParallel{cls.__name__}", (mixin, cls), {})
    return _classes[(cls, mixin)]


class VocabParallelEmbedding:
    """Mixed into the input ``nn.Embedding``'s class by ``shard_vocabulary``."""

    _vocab_shard: VocabShard

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _VocabParallelEmbedding.apply(input, self.weight.to_local(), self.padding_idx, self._vocab_shard)


class VocabParallelLMHead:
    """Mixed into the LM head's ``nn.Linear`` class by ``shard_vocabulary``: ``head(hidden)`` returns
    the full-vocabulary logits of this rank's tokens. The training loss does not call it: the causal
    LM's fused loss (``moetune.layers.lm_head_cross_entropy``) calls ``fused_cross_entropy``."""

    _vocab_shard: VocabShard
    weight: DTensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        h_TH = input.reshape(-1, input.shape[-1])
        logits_TV = _VocabParallelLogits.apply(h_TH, self.weight.to_local(), self._vocab_shard)
        return logits_TV.reshape(*input.shape[:-1], logits_TV.shape[-1])

    def fused_cross_entropy(
        self,
        hidden_TH: torch.Tensor,
        targets_T: torch.Tensor,
        *,
        num_items_in_batch: int | torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        chunk_rows: int | None = None,
    ) -> torch.Tensor:
        """``linear_cross_entropy``'s semantics on the split head (``vocab_parallel_cross_entropy``)."""
        normalizer = loss_normalizer(hidden_TH, self.weight.dtype, targets_T, num_items_in_batch=num_items_in_batch,
                                     ignore_index=ignore_index, vocab_size=self.weight.shape[0])  # fmt: skip
        return vocab_parallel_cross_entropy(
            hidden_TH, self.weight, targets_T, normalizer, chunk_rows=chunk_rows, ignore_index=ignore_index
        )


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w_SH, padding_idx, shard: VocabShard):
        ids_T = ids.reshape(-1)
        num, longest = ids_T.shape[0], shard.token_counts(ids_T.shape[0])
        ids_G = gather_rows(pad_rows(ids_T, longest, -1), shard.group, shard.world)
        local_G = ids_G - shard.start
        held_G = (local_G >= 0) & (local_G < shard.rows)
        local_G = torch.where(held_G, local_G, 0)
        rows_GH = torch.nn.functional.embedding(local_G, w_SH).masked_fill_(~held_G.unsqueeze(1), 0)
        out_TH = scatter_sum_rows(rows_GH, shard.group, shard.world)[:num]
        ctx.save_for_backward(local_G, held_G)
        ctx.shard, ctx.num, ctx.longest, ctx.shape = shard, num, longest, ids.shape
        held_padding = padding_idx is not None and 0 <= padding_idx - shard.start < shard.rows
        ctx.padding_idx = padding_idx - shard.start if held_padding else -1
        return out_TH.reshape(*ids.shape, w_SH.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        local_G, held_G = ctx.saved_tensors
        shard = ctx.shard
        grad_TH = pad_rows(grad_out.reshape(ctx.num, grad_out.shape[-1]), ctx.longest)
        grad_GH = gather_rows(grad_TH, shard.group, shard.world).masked_fill_(~held_G.unsqueeze(1), 0)
        grad_SH = torch.ops.aten.embedding_dense_backward(grad_GH, local_G, shard.rows, ctx.padding_idx, False)
        return None, grad_SH.div_(shard.world), None, None


class _VocabParallelLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_SH, shard: VocabShard):
        num, longest = h_TH.shape[0], shard.token_counts(h_TH.shape[0])
        ctx.dtypes = h_TH.dtype, w_SH.dtype
        with gemm_operands(h_TH, w_SH) as (h_TH_c, w_SH_c):  # autocast's dtype, as nn.Linear's logits
            h_GH = gather_rows(pad_rows(h_TH_c, longest), shard.group, shard.world)
            logits_GS = h_GH @ w_SH_c.t()
        # Block r of the rows goes to rank r; every block padded to the widest shard's columns.
        received = _all_to_all(_pad_columns(logits_GS, shard.max_rows), shard.group)
        logits_TV = torch.cat([received[r * longest : (r + 1) * longest, : shard.sizes[r]] for r in range(shard.world)], 1)
        ctx.save_for_backward(h_GH, w_SH_c)
        ctx.shard, ctx.num, ctx.longest = shard, num, longest
        return logits_TV[:num]

    @staticmethod
    def backward(ctx, grad_TV):
        h_GH, w_SH = ctx.saved_tensors
        shard, longest = ctx.shard, ctx.longest
        grad_TV = pad_rows(grad_TV, longest)
        blocks = torch.split(grad_TV, shard.sizes, dim=1)  # shard r's columns of this rank's tokens
        send = torch.cat([_pad_columns(block, shard.max_rows) for block in blocks])
        grad_GS = _all_to_all(send, shard.group)[:, : shard.rows]  # this shard's columns of every rank's tokens
        grad_GS = grad_GS.to(w_SH.dtype)
        grad_h = scatter_sum_rows(grad_GS @ w_SH, shard.group, shard.world)[: ctx.num] if ctx.needs_input_grad[0] else None
        grad_w = (grad_GS.t() @ h_GH).div_(shard.world) if ctx.needs_input_grad[1] else None
        return *as_dtypes((grad_h, ctx.dtypes[0]), (grad_w, ctx.dtypes[1])), None


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def vocab_parallel_cross_entropy(
    hidden_TH: torch.Tensor,
    weight_VH: DTensor,
    targets_T: torch.Tensor,
    normalizer: torch.Tensor,
    *,
    chunk_rows: int | None,
    ignore_index: int,
) -> torch.Tensor:
    """``linear_cross_entropy`` of a vocabulary-parallel head: this rank's loss (its tokens' losses
    summed and divided by its ``normalizer``), with every rank's tokens run through this rank's shard."""
    # From the weight itself (the loss gets the weight, not the module): a few integers per call. Its
    # token-count check under CUDA-graph capture is the input embedding's, which sees the same tokens.
    shard = VocabShard(weight_VH.device_mesh.get_group(), weight_VH.shape[0], what="the LM head's loss")
    w_SH = weight_VH.to_local()
    if chunk_rows is None:  # about 512 MiB of logits per chunk, as the replicated loss
        chunk_rows = max(1, (1 << 29) // (shard.max_rows * w_SH.element_size()))
    return _VocabParallelCrossEntropy.apply(hidden_TH, w_SH, targets_T, normalizer, shard, chunk_rows, ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_SH, targets_T, normalizer, shard: VocabShard, chunk_rows: int, ignore_index: int):
        needs_h, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        group, world = shard.group, shard.world
        num, longest = h_TH.shape[0], shard.token_counts(h_TH.shape[0])
        acc_dtype = normalizer.dtype
        # Ignored targets become -1 (in no shard); padding rows too.
        targets_G = gather_rows(pad_rows(torch.where(targets_T == ignore_index, -1, targets_T), longest, -1), group, world)
        normalizers_G = gather_rows(normalizer.reshape(1), group, world).repeat_interleave(longest)
        valid_G = targets_G >= 0
        # each row's loss weight on its own rank (0 for ignored rows, also where no row of a rank counts)
        scale_G = torch.where(valid_G, 1 / normalizers_G, 0.0).to(acc_dtype)
        loss_G = torch.zeros(targets_G.shape, dtype=acc_dtype, device=h_TH.device)
        grad_h_GH = grad_w_SH = None
        with gemm_operands(h_TH, w_SH) as (h_TH_c, w_SH_c):
            h_GH = gather_rows(pad_rows(h_TH_c, longest), group, world)
            grad_h_GH = torch.empty_like(h_GH) if needs_h else None
            for start in range(0, h_GH.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h_CH, targets_C = h_GH[rows], targets_G[rows]
                logits_CS = h_CH @ w_SH_c.t()  # the model dtype, as the replicated loss
                stats_R2C = gather_rows(cross_entropy_shard_stats(logits_CS, targets_C, shard.start), group, world)
                lse_C = torch.logsumexp(stats_R2C[0::2], dim=0)
                loss_G[rows] = (lse_C - stats_R2C[1::2].sum(0)) * valid_G[rows]
                if not (needs_h or needs_w):
                    continue
                cross_entropy_shard_grad_(logits_CS, targets_C, lse_C, scale_G[rows], shard.start)
                if needs_h:
                    grad_h_GH[rows] = logits_CS @ w_SH_c
                if needs_w:  # every rank's tokens: the average over the ranks is this sum / world
                    grad_w_SH = accumulate_head_grad(grad_w_SH, logits_CS.t(), h_CH, alpha=1.0 / world)
            grad_h_TH = scatter_sum_rows(grad_h_GH, group, world)[:num] if needs_h else None
        grad_h_TH, grad_w_SH = as_dtypes((grad_h_TH, h_TH.dtype), (grad_w_SH, w_SH.dtype))
        ctx.save_for_backward(grad_h_TH, grad_w_SH)
        ctx.used = False
        own = slice(shard.rank * longest, shard.rank * longest + num)
        return loss_G[own].sum() / normalizer

    @staticmethod
    def backward(ctx, grad_loss):
        return *saved_gradients_scaled(ctx, grad_loss), None, None, None, None, None
