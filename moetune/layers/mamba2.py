"""Mamba-2's sequence mixing for training: the depthwise causal convolution and the chunked SSD scan,
as a few batched matmuls, with packed documents kept apart.

Transformers' torch path (used when the compiled ``mamba-ssm`` / ``causal-conv1d`` packages are
absent) computes the same scan with per-head einsums over broadcast [chunk, chunk, heads] tensors:
168 ms and 33 GiB for one Nemotron 3 Nano mixer's forward + backward at 4096 tokens on an H200
(``benchmarks/probes/mamba2_probe.py``). Here B and C stay per group (the heads of a group share them),
every contraction is one ``bmm``, and the state passing between chunks is one matmul with a
[chunk, chunk] decay matrix: 11.3 ms and 2.1 GiB, 8.2 ms compiled (the default on CUDA, which
fuses the elementwise passes over the [chunk, chunk] tensors). Computation in fp32, as
Transformers' torch path, so the result equals it to fp32 rounding (the parity tests: 1e-5).

Documents: ``seq_idx`` [B, S] numbers the documents of each row (packed rows). A token sees the
convolution taps and the states of its own document only, as if each document were run alone from
zero state; the masks are built on the device (no host synchronisation, CUDA-graph capturable).

Letters: B = rows, S = tokens per row, C = chunks, L = chunk length (l, s: positions in a chunk),
H = heads, G = groups (B and C are shared by the R = H / G heads of a group), P = head dim,
N = state size, D = channels of the convolution.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def document_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Each token's document in its row: a new document starts at every position 0 (and the row's
    first token), as packed rows' position_ids restart."""
    starts_BS = position_ids_BS == 0
    starts_BS[:, 0] = True
    return torch.cumsum(starts_BS.to(torch.int32), dim=1)


def zero_padding(hidden_BSX: torch.Tensor, attention_mask_BS: torch.Tensor | None) -> torch.Tensor:
    """Padded positions (mask 0) zeroed, as Transformers' Mamba mixers do before the projection and
    after the convolution, so padding never enters a state."""
    if attention_mask_BS is None:
        return hidden_BSX
    return (hidden_BSX * attention_mask_BS[:, :, None]).to(hidden_BSX.dtype)


def causal_conv1d(x_BSD: torch.Tensor, weight_DK: torch.Tensor, bias_D: torch.Tensor | None, *,
                  seq_idx_BS: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """out[t] = bias + sum_k weight[:, K-1-k] * x[t-k] over the taps inside t's document, in fp32,
    returned in the weight's dtype (as ``F.conv1d`` with padding K-1, cut to S), then
    ``activation`` (a Transformers ``ACT2FN`` name, as the mixer's ``self.act``) on that result.

    On CUDA this runs compiled, like the scan: eagerly its K shifted copies, products and sums in
    fp32, forward and backward, were ~9 ms of an 8-layer Nemotron 3 Nano step on an H200 (four
    mixers at 4096 x 6144; profiled on 2026-12-01 at 66ef9b5)."""
    conv = _compiled_conv() if x_BSD.is_cuda and _compile_on_cuda() else _causal_conv1d
    return conv(x_BSD, weight_DK, bias_D, seq_idx_BS=seq_idx_BS, activation=activation)


def _causal_conv1d(x_BSD, weight_DK, bias_D, *, seq_idx_BS, activation):
    S, K = x_BSD.shape[1], weight_DK.shape[1]
    x32_BSD = x_BSD.float()
    out_BSD = x32_BSD * weight_DK[:, K - 1].float()
    for k in range(1, min(K, S)):  # taps reaching before a sequence shorter than the kernel add nothing
        shifted_BSD = F.pad(x32_BSD[:, : S - k], (0, 0, k, 0))  # x[t-k], zero before the row
        if seq_idx_BS is not None:
            same_BS = F.pad(seq_idx_BS[:, k:] == seq_idx_BS[:, : S - k], (k, 0))
            shifted_BSD = shifted_BSD * same_BS[..., None]
        out_BSD = out_BSD + shifted_BSD * weight_DK[:, K - 1 - k].float()
    if bias_D is not None:
        out_BSD = out_BSD + bias_D.float()
    out_BSD = out_BSD.to(weight_DK.dtype)
    return out_BSD if activation is None else ACT2FN[activation](out_BSD)


@functools.cache
def _compiled_conv():
    return torch.compile(_causal_conv1d, dynamic=False, fullgraph=True)


def gated_rms_norm(norm: torch.nn.Module, y_BSX: torch.Tensor, gate_BSX: torch.Tensor) -> torch.Tensor:
    """The mixer's gated, grouped RMSNorm (Transformers' module, e.g. ``NemotronHRMSNormGated``)
    applied to the scan's output: its own forward, compiled on CUDA, where its eight fp32 passes
    over [S, intermediate] otherwise run one by one, forward and backward."""
    forward = _compiled_forward(type(norm)) if y_BSX.is_cuda and _compile_on_cuda() else type(norm).forward
    return forward(norm, y_BSX, gate_BSX)


@functools.cache
def _compiled_forward(module_cls: type) -> Callable:
    return torch.compile(module_cls.forward, dynamic=False, fullgraph=True)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[B, S, ...] -> [B, C, L, ...], zero-padded at the end."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.view(t.shape[0], -1, chunk, *t.shape[2:])


def chunked_scan(
    x_BSHP: torch.Tensor,
    dt_BSH: torch.Tensor,
    A_H: torch.Tensor,
    B_BSGN: torch.Tensor,
    C_BSGN: torch.Tensor,
    *,
    chunk_size: int,
    D_H: torch.Tensor | None = None,
    dt_bias_H: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    seq_idx_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_t = sum_{s <= t, same document} C_t . (prod_{s < k <= t} exp(dt_k A)) dt_s B_s x_s + D x_t,
    with dt = clamp(softplus(dt + dt_bias), dt_limit) (Transformers' ``mamba2_chunk_scan`` with
    ``dt_softplus=True``, no initial state). Returns fp32 [B, S, H, P]."""
    scan = _compiled_scan() if x_BSHP.is_cuda and _compile_on_cuda() else _chunked_scan
    with torch.autocast(x_BSHP.device.type, enabled=False):  # fp32 throughout, as Transformers' path
        return scan(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, chunk_size=chunk_size, D_H=D_H,
                    dt_bias_H=dt_bias_H, dt_limit=dt_limit, seq_idx_BS=seq_idx_BS)


def _compile_on_cuda() -> bool:
    """On CUDA the scan, the convolution and the gated norm run compiled (inductor fuses the
    elementwise passes, over the [chunk, chunk] tensors in the scan, which dominate them eagerly);
    ``MOETUNE_MAMBA2_COMPILE=0`` keeps them eager."""
    return os.environ.get("MOETUNE_MAMBA2_COMPILE", "1") != "0"


@functools.cache
def _compiled_scan():
    # One graph per shape (no dynamic shapes: training shapes are few and fixed); torch's recompile
    # limit sends further shapes to the eager function.
    return torch.compile(_chunked_scan, dynamic=False, fullgraph=True)


def _chunked_scan(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, *, chunk_size, D_H, dt_bias_H, dt_limit, seq_idx_BS):
    Bsz, S, H, P = x_BSHP.shape
    G, N = B_BSGN.shape[2], B_BSGN.shape[3]
    R, L = H // G, chunk_size
    if dt_bias_H is not None:
        dt_BSH = dt_BSH + dt_bias_H.to(dt_BSH.dtype)
    dt_BSH = F.softplus(dt_BSH).clamp(min=dt_limit[0], max=dt_limit[1]).float()  # softplus in dt's dtype, as Transformers
    x32_BSHP = x_BSHP.float()
    pad = (-S) % L
    xdt_BCLHP = _chunks(x32_BSHP * dt_BSH[..., None], pad, L)
    a_BCLH = _chunks(A_H.float() * dt_BSH, pad, L)  # log-decay per token (padding: 0, and adds nothing)
    B_BCLGN, C_BCLGN = _chunks(B_BSGN.float(), pad, L), _chunks(C_BSGN.float(), pad, L)
    Cn = xdt_BCLHP.shape[1]
    acs_BHCL = torch.cumsum(a_BCLH.permute(0, 3, 1, 2), dim=-1)  # log-decay from the chunk's start

    seq_BCL = None if seq_idx_BS is None else _chunks(seq_idx_BS[..., None], pad, L)[..., 0]
    if seq_BCL is not None and pad:
        seq_BCL = seq_BCL.clone()
        seq_BCL.view(Bsz, -1)[:, S:] = seq_idx_BS[:, -1:]  # padding belongs to the last document

    # 1. Within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(acs_l - acs_s) xdt_s.
    CB_BCGLL = torch.matmul(C_BCLGN.transpose(2, 3), B_BCLGN.permute(0, 1, 3, 4, 2))
    keep_LL = torch.ones(L, L, dtype=torch.bool, device=x_BSHP.device).tril()
    if seq_BCL is not None:
        keep_LL = (keep_LL & (seq_BCL[..., :, None] == seq_BCL[..., None, :])).unsqueeze(1)  # [B, 1, C, L, L]
    gaps_BHCLL = acs_BHCL[..., :, None] - acs_BHCL[..., None, :]
    decay_BHCLL = torch.exp(gaps_BHCLL.masked_fill(~keep_LL, float("-inf")))
    decay_BCGRLL = decay_BHCLL.permute(0, 2, 1, 3, 4).reshape(Bsz, Cn, G, R, L, L)
    scores_BCGRLL = CB_BCGLL.unsqueeze(3) * decay_BCGRLL
    xdt_BCGRLP = xdt_BCLHP.permute(0, 1, 3, 2, 4).reshape(Bsz, Cn, G, R, L, P)
    y_BCGRLP = torch.matmul(scores_BCGRLL, xdt_BCGRLP)

    # 2. Each chunk's own contribution to the state at its end: sum_l exp(acs_last - acs_l) B_l xdt_l^T.
    to_end_BHCL = acs_BHCL[..., -1:] - acs_BHCL
    if seq_BCL is not None:
        to_end_BHCL = to_end_BHCL.masked_fill((seq_BCL != seq_BCL[..., -1:]).unsqueeze(1), float("-inf"))
    weighted_BCGRLP = xdt_BCGRLP * torch.exp(to_end_BHCL).permute(0, 2, 1, 3).reshape(Bsz, Cn, G, R, L, 1)
    own_BCGRPN = torch.matmul(weighted_BCGRLP.transpose(-1, -2), B_BCLGN.transpose(2, 3).unsqueeze(3))

    # 3. The states at the chunks' ends: state_c = sum_{z <= c} exp(cs_c - cs_z) own_z (same document).
    cs_BHC = torch.cumsum(acs_BHCL[..., -1], dim=-1)
    between_BHCC = cs_BHC[..., :, None] - cs_BHC[..., None, :]
    keep_CC = torch.ones(Cn, Cn, dtype=torch.bool, device=x_BSHP.device).tril()
    if seq_BCL is not None:
        end_BC = seq_BCL[..., -1]
        keep_CC = keep_CC & (end_BC[:, :, None] == end_BC[:, None, :]).unsqueeze(1)
    carry_BHCC = torch.exp(between_BHCC.masked_fill(~keep_CC, float("-inf")))
    own_BHCX = own_BCGRPN.reshape(Bsz, Cn, H, P * N).transpose(1, 2)
    state_BHCX = torch.matmul(carry_BHCC, own_BHCX)
    # The state entering chunk c is the one at the end of chunk c - 1 (zero before the first).
    entering_BHCX = F.pad(state_BHCX[:, :, :-1], (0, 0, 1, 0))

    # 4. The entering state's output: y_l += exp(acs_l) C_l . state (for l in the state's document).
    entering_BCGNX = entering_BHCX.view(Bsz, H, Cn, P, N).permute(0, 2, 1, 4, 3).reshape(Bsz, Cn, G, R, N, P)
    from_state_BCGRLP = torch.matmul(C_BCLGN.transpose(2, 3).unsqueeze(3), entering_BCGNX)
    into_BHCL = acs_BHCL
    if seq_BCL is not None:
        previous_end_BC = F.pad(seq_BCL[..., -1], (1, 0), value=-1)[:, :-1]
        into_BHCL = into_BHCL.masked_fill((seq_BCL != previous_end_BC[..., None]).unsqueeze(1), float("-inf"))
    y_BCGRLP = y_BCGRLP + from_state_BCGRLP * torch.exp(into_BHCL).permute(0, 2, 1, 3).reshape(Bsz, Cn, G, R, L, 1)

    y_BSHP = y_BCGRLP.reshape(Bsz, Cn, H, L, P).transpose(2, 3).reshape(Bsz, Cn * L, H, P)[:, :S]
    if D_H is not None:
        y_BSHP = y_BSHP + D_H[:, None] * x32_BSHP
    return y_BSHP
