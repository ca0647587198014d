"""Samples -> fixed-size micro-batches, with deterministic shuffling and a resumable position.

Packing puts several samples in one row of ``max_length`` tokens. Each sample's position_ids
restart at 0 and no attention mask is passed: Transformers then derives the document
boundaries from the position_ids (``masking_utils.find_packed_sequence_indices``), which gives a
block-diagonal causal mask with sdpa/eager (the CPU path), a document mask with
flex_attention, and varlen kernels (cu_seqlens) with flash_attention_2/3 on GPU. Models whose
attention takes the documents' offsets (moetune's Qwen3-MoE) get them too (``cu_seq_lens_q``,
computed here on the CPU): they then build no mask, never synchronise with the host for it, and
on GPU run the variable-length flash kernel, which skips the blocks across documents. The first
token of each sample gets no label, so no token is ever predicted across a boundary.

Letters: B = rows in a micro-batch, T = tokens per row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from moetune.layers.document_attention import document_offsets as offsets_of
from moetune.recipe.config import PACKING_STRATEGIES
from moetune.recipe.formatting import IGNORE_INDEX, Sample


@dataclass
class Batch:
    """One micro-batch, as tensors on the CPU."""

    input_ids_BT: torch.Tensor
    labels_BT: torch.Tensor
    position_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor | None
    """None for packed batches (boundaries come from position_ids); 1/0 padding mask otherwise."""
    real_BT: torch.Tensor
    """True on real tokens, False on padding (for expert-load counts)."""
    num_tokens: int
    """Real (non-padding) tokens."""
    num_label_tokens: int
    """Tokens that carry a loss (labels != IGNORE_INDEX after the causal shift)."""
    document_lengths: list[list[int]] | None = None
    """Packed batches: the length of each document of each row (samples, then the padding run)."""
    sample_lengths: list[int] = field(default_factory=list)
    """The length of every sample in the batch (no padding): attention FLOPs count each at its own."""

    def model_inputs(self, device: torch.device, *, document_offsets: bool = False,
                     num_offsets: int | None = None) -> dict[str, torch.Tensor | bool | int]:
        """The model's keyword arguments. ``document_offsets`` (packed batches, models whose attention
        takes them): also the documents' offsets (``cu_seq_lens_q``, moetune.layers.document_attention),
        so that no mask is derived from the positions; ``num_offsets`` pads them to a fixed length and
        bounds the longest document by the row (the fixed shapes of a CUDA-graph step)."""
        inputs: dict[str, torch.Tensor] = {
            "input_ids": self.input_ids_BT, "labels": self.labels_BT, "position_ids": self.position_ids_BT,
        }
        if self.attention_mask_BT is not None:
            inputs["attention_mask"] = self.attention_mask_BT
        if document_offsets and self.document_lengths is not None:
            width = self.input_ids_BT.shape[1]
            inputs["cu_seq_lens_q"] = inputs["cu_seq_lens_k"] = offsets_of(
                self.document_lengths, row_length=width, num_offsets=num_offsets)
        moved: dict[str, torch.Tensor | bool | int] = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        if "cu_seq_lens_q" in moved:
            longest = width if num_offsets is not None else max(max(row) for row in self.document_lengths)
            moved["max_length_q"] = moved["max_length_k"] = longest
        # Transformers derives the packed-document mask from position_ids only without a KV
        # cache; with one (use_cache defaults to True, even in training) attention would silently
        # cross the sample boundaries.
        moved["use_cache"] = False
        return moved


def pack(samples: list[Sample], *, max_length: int, strategy: str = "best_fit") -> list[list[Sample]]:
    """Samples -> rows of at most ``max_length`` tokens.

    - ``"best_fit"`` (best-fit decreasing): the longest sample first, each into the open row it
      fills most tightly, else a new row. Rows come out in creation order (longest first): shuffle
      them for training. On the recipe's benchmark data (200-3,000-token samples, 4,096-token rows)
      real tokens fill 99.8% of the rows, against 74% for ``"in_order"``; the padding is compute
      spent on nothing, so tokens/s rises by about that ratio.
    - ``"in_order"`` (next-fit): samples in the given order; a row is closed when the next sample
      does not fit. Keeps the data order (a curriculum) at the price of the padding.
    """
    for sample in samples:
        assert len(sample.input_ids) <= max_length, "samples are truncated to max_length before packing"
    if strategy == "in_order":
        return _pack_in_order(samples, max_length)
    if strategy != "best_fit":
        raise ValueError(f"data.packing_strategy: {strategy!r} is not one of {', '.join(PACKING_STRATEGIES)}")
    rows: list[list[Sample]] = []
    open_rows = _RowsByFreeSpace(max_length)
    # sorted() is stable: samples of one length keep the given (shuffled) order.
    for sample in sorted(samples, key=lambda s: len(s.input_ids), reverse=True):
        n = len(sample.input_ids)
        fit = open_rows.pop_best_fit(n)
        if fit is None:
            row, free = len(rows), max_length
            rows.append([])
        else:
            row, free = fit
        rows[row].append(sample)
        if free - n > 0:
            open_rows.add(row, free - n)
    return rows


def _pack_in_order(samples: list[Sample], max_length: int) -> list[list[Sample]]:
    rows: list[list[Sample]] = []
    current: list[Sample] = []
    used = 0
    for sample in samples:
        n = len(sample.input_ids)
        if used + n > max_length:
            rows.append(current)
            current, used = [], 0
        current.append(sample)
        used += n
    if current:
        rows.append(current)
    return rows


class _RowsByFreeSpace:
    """Open rows bucketed by free space, with a count tree over the free-space values 0..max_length:
    the tightest row a sample fits (the smallest free space >= its length) is found in
    O(log max_length), so packing an epoch of N samples costs O(N log max_length)."""

    def __init__(self, max_length: int) -> None:
        self.leaves = 1 << max_length.bit_length()  # leaf i counts the rows with i tokens free
        self.count = [0] * (2 * self.leaves)
        self.rows_by_free: dict[int, list[int]] = {}

    def _update(self, free: int, delta: int) -> None:
        node = free + self.leaves
        while node:
            self.count[node] += delta
            node //= 2

    def add(self, row: int, free: int) -> None:
        self.rows_by_free.setdefault(free, []).append(row)
        self._update(free, 1)

    def pop_best_fit(self, length: int) -> tuple[int, int] | None:
        """(row, its free space) of the open row with the least free space >= ``length``, removed
        from the open rows; None when no row has room."""
        node = length + self.leaves
        if self.count[node] == 0:
            # Climb until a right sibling holds a row, then descend to its leftmost non-empty leaf.
            while node > 1 and not (node % 2 == 0 and self.count[node + 1] > 0):
                node //= 2
            if node == 1:
                return None
            node += 1
            while node < self.leaves:
                node = 2 * node if self.count[2 * node] > 0 else 2 * node + 1
        free = node - self.leaves
        row = self.rows_by_free[free].pop()
        self._update(free, -1)
        return row, free


def collate(rows: list[list[Sample]], *, pad_id: int, max_length: int, packed: bool,
            pad_to_multiple_of: int = 0) -> Batch:
    """Rows of samples -> a Batch. Packed rows are padded to ``max_length`` (fixed shapes);
    unpacked rows hold one sample each and are padded to the longest, rounded up to a multiple of
    ``pad_to_multiple_of`` when that is set. Filled as numpy arrays (a 4,096-token row in ~0.5 ms:
    ``torch.tensor`` of nested lists took ~3 ms of the host's step)."""
    width = max_length if packed else max(len(r[0].input_ids) for r in rows)
    if not packed and pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(rows), width)
    ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    real = np.zeros(shape, dtype=bool)
    lengths = []
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            n = len(sample.input_ids)
            ids[r, start:start + n] = sample.input_ids
            # No label on a sample's first token: it would be predicted from the previous sample.
            labels[r, start + 1:start + n] = sample.labels[1:]
            positions[r, start:start + n] = np.arange(n)
            start += n
        pad = width - start
        # Padding continues as one more "document" so it never joins a real sample's attention.
        positions[r, start:] = np.arange(pad)
        real[r, :start] = True
        lengths.append([len(sample.input_ids) for sample in row] + ([pad] if pad else []))
    return Batch(
        input_ids_BT=torch.from_numpy(ids),
        labels_BT=torch.from_numpy(labels),
        position_ids_BT=torch.from_numpy(positions),
        attention_mask_BT=None if packed else torch.from_numpy(real.astype(np.int64)),
        real_BT=torch.from_numpy(real),
        num_tokens=int(real.sum()),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()),
        document_lengths=lengths if packed else None,
        sample_lengths=[len(sample.input_ids) for row in rows for sample in row],
    )


def max_documents_per_row(samples: list[Sample], *, max_length: int) -> int:
    """An upper bound on the documents of a packed row (the padding run counts as one): the fixed
    number of document offsets per row of a CUDA-graph step."""
    shortest = min((len(s.input_ids) for s in samples), default=max_length)
    return min(max_length, max_length // max(shortest, 1) + 1)


def split_validation(samples: list[Sample], *, fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, validation): a seeded random ``fraction`` of the samples is held out."""
    num_val = int(len(samples) * fraction)
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    val_ids = set(order[:num_val])
    train = [s for i, s in enumerate(samples) if i not in val_ids]
    val = [s for i, s in enumerate(samples) if i in val_ids]
    return train, val


@dataclass
class DataPosition:
    """Where the batch stream is; all it takes to resume it exactly."""

    epoch: int = 0
    micro_batch: int = 0
    """Index of the next micro-batch within the epoch."""


class BatchStream:
    """Endless stream of this rank's micro-batches: each epoch reshuffles the samples with
    ``seed + epoch``, packs them, and deals micro-batches to ranks round-robin."""

    def __init__(self, samples: list[Sample], *, micro_batch_size: int, max_length: int, packed: bool,
                 pad_id: int, seed: int, rank: int = 0, world_size: int = 1,
                 packing_strategy: str = "best_fit", pad_to_multiple_of: int = 0) -> None:
        if not samples:
            raise ValueError("data.train_path: no usable training samples")
        self.samples, self.micro_batch_size, self.max_length = samples, micro_batch_size, max_length
        self.packed, self.pad_id, self.seed, self.packing_strategy = packed, pad_id, seed, packing_strategy
        self.rank, self.world_size, self.pad_to_multiple_of = rank, world_size, pad_to_multiple_of
        self.position = DataPosition()
        self._epoch_batches: list[list[list[Sample]]] | None = None
        self._epoch_of_batches = -1

    def _batches_of_epoch(self, epoch: int) -> list[list[list[Sample]]]:
        if self._epoch_of_batches != epoch:
            order = list(range(len(self.samples)))
            rng = random.Random(self.seed + epoch)
            rng.shuffle(order)
            shuffled = [self.samples[i] for i in order]
            if self.packed:
                rows = pack(shuffled, max_length=self.max_length, strategy=self.packing_strategy)
                if self.packing_strategy == "best_fit":
                    rng.shuffle(rows)  # best-fit rows come longest sample first
            else:
                rows = [[s] for s in shuffled]
            per_step = self.micro_batch_size * self.world_size
            # Whole global micro-batches only, so every rank runs the same number of steps.
            num = len(rows) // per_step
            if num == 0:
                raise ValueError(f"training.micro_batch_size: {self.micro_batch_size} rows x {self.world_size} "
                                 f"ranks is more than the {len(rows)} rows of one epoch")
            first = self.rank * self.micro_batch_size
            self._epoch_batches = [rows[g * per_step + first: g * per_step + first + self.micro_batch_size]
                                   for g in range(num)]
            self._epoch_of_batches = epoch
        assert self._epoch_batches is not None
        return self._epoch_batches

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batches = self._batches_of_epoch(self.position.epoch)
        if self.position.micro_batch >= len(batches):
            self.position = DataPosition(epoch=self.position.epoch + 1, micro_batch=0)
            batches = self._batches_of_epoch(self.position.epoch)
        rows = batches[self.position.micro_batch]
        self.position = DataPosition(epoch=self.position.epoch, micro_batch=self.position.micro_batch + 1)
        return collate(rows, pad_id=self.pad_id, max_length=self.max_length, packed=self.packed,
                       pad_to_multiple_of=self.pad_to_multiple_of)

    def state_dict(self) -> dict:
        state: dict = {"epoch": self.position.epoch, "micro_batch": self.position.micro_batch}
        if self.packed:  # the position counts rows, which depend on how samples were packed
            state["packing_strategy"] = self.packing_strategy
        return state

    def check_resumable(self, state: dict, where: str = "checkpoint.resume") -> None:
        check_resumable(state, packed=self.packed, packing_strategy=self.packing_strategy, where=where)

    def load_state_dict(self, state: dict) -> None:
        self.check_resumable(state)
        self.position = DataPosition(epoch=int(state["epoch"]), micro_batch=int(state["micro_batch"]))


def check_resumable(state: dict, *, packed: bool, packing_strategy: str, where: str = "checkpoint.resume") -> None:
    """Raise if the data position ``state`` counts rows packed another way than ``packing_strategy``
    (the resume would repeat some samples and skip others). Checkpoints from before
    ``data.packing_strategy`` existed packed in order."""
    saved = state.get("packing_strategy", "in_order")
    if packed and saved != packing_strategy:
        raise ValueError(
            f"{where}: the checkpoint's data position counts rows packed with data.packing_strategy "
            f"{saved!r}, this job packs with {packing_strategy!r}: the resume would not continue the "
            f"same data order. Resume with --data.packing_strategy {saved}")


def fixed_batches(samples: list[Sample], *, micro_batch_size: int, max_length: int, packed: bool,
                  pad_id: int, rank: int = 0, world_size: int = 1, packing_strategy: str = "best_fit",
                  pad_to_multiple_of: int = 0) -> list[Batch]:
    """All of ``samples`` (no shuffling, no dropping), this rank's share: for validation.

    Every rank gets the same number of batches (short ranks get all-padding ones without labels):
    under FSDP each forward is a collective, so the ranks must run as many."""
    rows = pack(samples, max_length=max_length, strategy=packing_strategy) if packed else [[s] for s in samples]
    per_rank = -(-len(rows) // world_size)
    padding_row = [Sample(input_ids=[pad_id], labels=[IGNORE_INDEX])]
    mine = rows[rank::world_size]
    mine += [padding_row] * (per_rank - len(mine))
    return [collate(mine[i:i + micro_batch_size], pad_id=pad_id, max_length=max_length, packed=packed,
                    pad_to_multiple_of=pad_to_multiple_of)
            for i in range(0, len(mine), micro_batch_size)]
