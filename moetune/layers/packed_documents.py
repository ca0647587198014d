"""Recurrent layers (Mamba-2 and the like) over packed rows, one document at a time.

A recurrent mixer carries its state and its causal convolution along the row, so in a packed row
one document would start from the previous document's state. Transformers' torch paths take no
document boundaries. Here the documents (found where ``position_ids`` restart at 0) are gathered
into a right-padded batch of their own, [documents, longest document, H], with a padding mask,
run through the unchanged mixer, and scattered back into the packed order: each document starts
from zero state, and the padding after a document cannot reach it (the mixer is causal and
zeroes masked inputs). Costs the padding of documents to the longest one and two host reads per
layer call (eager training only; a CUDA-graph capture refuses it).

Letters: B = rows, S = tokens per row, T = B x S, H = hidden, N = documents, L = longest document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DocumentLayout:
    """Where each token of the flattened batch goes in the padded per-document batch."""

    document_T: torch.Tensor
    position_T: torch.Tensor
    mask_NL: torch.Tensor
    """1 on a document's tokens, 0 on the padding after it (int64, as Transformers' masks)."""


def document_layout(position_ids_BS: torch.Tensor) -> DocumentLayout | None:
    """The documents of packed rows (every row starts one; each 0 in ``position_ids`` starts another),
    or None when every row is a single document (nothing to split)."""
    B, S = position_ids_BS.shape
    starts_BS = position_ids_BS == 0
    starts_BS[:, 0] = True
    num_documents = int(starts_BS.sum())  # host reads: the number of documents and the longest
    if num_documents == B:
        return None
    document_T = torch.cumsum(starts_BS.reshape(-1).long(), 0) - 1
    lengths_N = torch.bincount(document_T, minlength=num_documents)
    first_N = torch.cumsum(lengths_N, 0) - lengths_N
    position_T = torch.arange(B * S, device=position_ids_BS.device) - first_N[document_T]
    longest = int(lengths_N.max())
    mask_NL = (torch.arange(longest, device=position_ids_BS.device)[None, :] < lengths_N[:, None]).long()
    return DocumentLayout(document_T=document_T, position_T=position_T, mask_NL=mask_NL)


def per_document(mixer: Callable[..., torch.Tensor], hidden_BSH: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
    """``mixer(hidden, attention_mask=mask)`` on each document alone, back in packed order [B, S, H]."""
    B, S, H = hidden_BSH.shape
    N, L = layout.mask_NL.shape
    padded_NLH = hidden_BSH.new_zeros(N, L, H).index_put((layout.document_T, layout.position_T), hidden_BSH.reshape(B * S, H))
    out_NLH = mixer(padded_NLH, attention_mask=layout.mask_NL)
    return out_NLH[layout.document_T, layout.position_T].view(B, S, -1)
