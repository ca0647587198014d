"""Causal attention within each document of packed rows, given the documents' offsets.

Packed training rows hold several documents; a token attends only to the earlier tokens of its own
document. Transformers finds the boundaries from ``position_ids`` on every forward, which reads a
device value on the host (a synchronisation that a CUDA-graph capture cannot do) and, with SDPA,
builds an [S, S] mask that drops the fast attention kernels. Callers that know the boundaries
pass them instead, as Transformers' flash-attention path takes them (``FlashAttentionKwargs``,
e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): ``cu_seq_lens_q`` holds
the document offsets into the batch's flattened B x S tokens (int32, starting at 0, ending at
B x S, documents never crossing a row) and ``max_length_q`` the longest document (an upper bound
is fine). Trailing repeats of the last offset are empty documents, so a CUDA-graph step can pad
the offsets to one fixed length.

On CUDA in bf16/fp16 the attention runs torch's variable-length flash kernel
(``torch.nn.attention.varlen``, torch >= 2.10), which skips the blocks across documents;
elsewhere SDPA with the block-diagonal causal mask built on the device from the offsets (no host
synchronisation either).

Letters: B = rows, S = tokens per row, T = B x S tokens, H = query heads, K = key/value heads,
D = head dim, N = documents + 1 offsets.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from moetune.utils.autocast import cuda_autocast_dtype

OFFSETS_KEY = "cu_seq_lens_q"
"""The keyword under which Transformers' flash-attention kwargs carry the document offsets."""
DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def pop_documents(kwargs: dict) -> tuple[torch.Tensor | None, int | None]:
    """An attention layer's documents: the offsets and the longest document, taken out of its kwargs
    with the other flash-attention keys (which a non-varlen attention would not take)."""
    offsets_N, max_length = kwargs.pop(OFFSETS_KEY, None), kwargs.pop("max_length_q", None)
    for name in DOCUMENT_KEYS:
        kwargs.pop(name, None)
    return offsets_N, max_length


def has_cache(kwargs: dict) -> bool:
    """Whether a layer's kwargs carry a KV / recurrent cache (named ``cache`` from Transformers 5.24
    on, ``past_key_values`` or ``cache_params`` before)."""
    return any(kwargs.get(name) is not None for name in ("cache", "past_key_values", "cache_params"))


def offsets_from_positions(position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The document offsets (int32, on the positions' device) and the longest document of packed rows
    given only their ``position_ids`` (TRL's packing under SDPA), or None unless every row's positions
    restart at 0 with each document and count up by one inside it: the documents Transformers' masks
    find in such positions. One host synchronisation, as Transformers' own check for packed positions
    takes."""
    if not isinstance(position_ids_BS, torch.Tensor) or position_ids_BS.dim() != 2 or position_ids_BS.is_floating_point():
        return None
    rows, length = position_ids_BS.shape
    if rows * length == 0:
        return None
    index_S = torch.arange(length, device=position_ids_BS.device)
    starts_BS = position_ids_BS == 0
    # Each position's document start: the last index <= it where the positions restart.
    first_BS = torch.where(starts_BS, index_S, torch.zeros_like(index_S)).cummax(dim=1).values
    exact = starts_BS[:, 0].all() & (position_ids_BS == index_S - first_BS).all()
    flags = torch.cat([exact.view(1), starts_BS.flatten()]).cpu()  # the one synchronisation
    if not bool(flags[0]):
        return None
    offsets = [*flags[1:].nonzero().flatten().tolist(), rows * length]
    longest = max(end - start for start, end in zip(offsets, offsets[1:]))
    return torch.tensor(offsets, dtype=torch.int32).to(position_ids_BS.device), longest


def document_offsets(lengths_per_row: list[list[int]], *, row_length: int, num_offsets: int | None = None) -> torch.Tensor:
    """The int32 offsets of documents with these lengths (each row's lengths sum to ``row_length``),
    padded with the total to ``num_offsets`` entries when given (a fixed shape for CUDA graphs)."""
    offsets = [0]
    for row, lengths in enumerate(lengths_per_row):
        if sum(lengths) != row_length or any(n <= 0 for n in lengths):
            raise ValueError(f"document lengths of row {row} must be positive and sum to {row_length}, got {lengths}")
        for n in lengths:
            offsets.append(offsets[-1] + n)
    if num_offsets is not None:
        if num_offsets < len(offsets):
            raise ValueError(f"{len(offsets) - 1} documents do not fit in {num_offsets} offsets")
        offsets += [offsets[-1]] * (num_offsets - len(offsets))
    return torch.tensor(offsets, dtype=torch.int32)


def document_causal_attention(
    q_BSHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKD: torch.Tensor,
    offsets_N: torch.Tensor,
    *,
    max_length: int,
    scaling: float,
) -> torch.Tensor:
    """Causal attention inside each document; returns [B, S, H, Dv] (Dv: the values' head dim, which
    may differ from the queries' as in DeepSeek-V3's MLA: torch's flash kernels need them equal, so
    such attention takes the masked SDPA path). ``offsets_N`` as described above."""
    B, S, H, D = q_BSHD.shape
    K = k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"document attention: {H} query heads are not a multiple of {K} key/value heads")
    if offsets_N.dim() != 1 or offsets_N.numel() < 2:
        raise ValueError(f"document attention: cu_seq_lens_q must be 1-D with >= 2 offsets, got {tuple(offsets_N.shape)}")
    dtype = cuda_autocast_dtype(q_BSHD) or q_BSHD.dtype  # SDPA's dtype under autocast
    varlen = _varlen_kernel() if flash_kernels_apply(q_BSHD) and v_BSKD.shape[-1] == D else None
    if varlen is not None:
        # Under autocast the projections may come in different dtypes; SDPA would cast them too.
        q_BSHD, k_BSKD, v_BSKD = (t.to(dtype) for t in (q_BSHD, k_BSKD, v_BSKD))
        offsets_N = offsets_N.to(device=q_BSHD.device, dtype=torch.int32)
        out_THD = varlen(
            q_BSHD.reshape(B * S, H, D), k_BSKD.reshape(B * S, K, D), v_BSKD.reshape(B * S, K, D),
            offsets_N, max(1, min(int(max_length), S)), scaling,
        )  # fmt: skip
        return out_THD.view(B, S, H, D)
    return _masked_sdpa(q_BSHD, k_BSKD, v_BSKD, offsets_N, scaling=scaling)


def _masked_sdpa(q_BSHD, k_BSKD, v_BSKD, offsets_N, *, scaling: float) -> torch.Tensor:
    B, S, H, _ = q_BSHD.shape
    K = k_BSKD.shape[2]
    mask_B1SS = document_causal_mask(offsets_N.to(q_BSHD.device), batch=B, seq_len=S)
    k_BKSD, v_BKSD = k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2)
    if K != H:  # SDPA's enable_gqa needs torch >= 2.5 and not every backend takes it: expand
        k_BKSD = k_BKSD.repeat_interleave(H // K, dim=1)
        v_BKSD = v_BKSD.repeat_interleave(H // K, dim=1)
    out_BHSD = F.scaled_dot_product_attention(q_BSHD.transpose(1, 2), k_BKSD, v_BKSD, attn_mask=mask_B1SS, scale=scaling)
    return out_BHSD.transpose(1, 2)


def document_causal_mask(offsets_N: torch.Tensor, *, batch: int, seq_len: int) -> torch.Tensor:
    """[B, 1, S, S] bool: query i sees key j of its row when both are in one document and j <= i."""
    positions_T = torch.arange(batch * seq_len, device=offsets_N.device, dtype=offsets_N.dtype)
    # The document of each token: how many offsets after the first are <= its position.
    document_BS = torch.searchsorted(offsets_N[1:].contiguous(), positions_T, right=True).view(batch, seq_len)
    same_BSS = document_BS[:, :, None] == document_BS[:, None, :]
    causal_SS = torch.ones(seq_len, seq_len, dtype=torch.bool, device=offsets_N.device).tril()
    return (same_BSS & causal_SS).unsqueeze(1)


def flash_kernels_apply(q: torch.Tensor) -> bool:
    """Whether torch's flash / cuDNN attention kernels can take queries ``q``: CUDA sm80+, half
    precision (``q``'s dtype or CUDA autocast's), head dim a multiple of 8 up to 256. They also
    need values as wide as the queries: the caller's to arrange."""
    dtype = cuda_autocast_dtype(q) or q.dtype
    head_dim = q.shape[-1]
    return (q.is_cuda and dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256
            and _has_flash_attention(q.device.index))


def cudnn_attention_applies(q: torch.Tensor) -> bool:
    """Whether SDPA's cuDNN kernels run causal attention of queries ``q`` where torch >= 2.9 tries
    them first: half precision, cuDNN >= 9.10 (its first with values narrower than the queries) on
    sm90 / sm100 (Hopper, datacenter Blackwell), the cuDNN backend enabled and no deterministic
    algorithms asked for (SDPA then skips cuDNN, whose backward is not deterministic).

    Its two users: DeepSeek-V3's values (128 wide against 192-wide queries) stay unpadded there,
    where padding them for the flash kernels costs 1160 against 796 us forward + backward at
    Moonlight-16B-A3B's shapes on an H200 (benchmarks/results/mla_attention_probe_h200_c574802.jsonl; elsewhere SDPA would take
    the memory-efficient kernel for narrow values, 7,475 us); and GPT-OSS's sink attention takes
    cuDNN's kernels directly for its full-attention layers (``moetune.layers.sink_attention``)."""
    if not flash_kernels_apply(q) or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if torch.are_deterministic_algorithms_enabled():
        return False
    version = torch.backends.cudnn.version() or 0
    return version >= 91000 and torch.cuda.get_device_capability(q.device.index)[0] in (9, 10)


@functools.cache
def _has_flash_attention(device_index: int | None) -> bool:
    """torch's flash kernels need sm80 (Ampere) or newer; older GPUs take the masked SDPA path."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@functools.cache
def _varlen_kernel():
    """``fn(q_THD, k_TKD, v_TKD, offsets, max_length, scale) -> out_THD`` over torch's varlen flash
    attention, whatever its keyword set in this torch version (2.10: ``is_causal``; later:
    ``window_size``, ``scale``, ``enable_gqa``); None when torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    has_scale, has_gqa = "scale" in params, "enable_gqa" in params

    def run(q_THD, k_TKD, v_TKD, offsets_N, max_length, scale):
        extra = dict(causal)
        if has_scale:
            extra["scale"] = scale
        elif abs(scale - q_THD.shape[-1] ** -0.5) > 1e-12 * scale:
            raise ValueError("document attention: this torch's varlen attention has no scale argument; "
                             "upgrade torch (>= 2.11) for a non-default attention scale")
        if k_TKD.shape[1] != q_THD.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:
                groups = q_THD.shape[1] // k_TKD.shape[1]
                k_TKD, v_TKD = k_TKD.repeat_interleave(groups, dim=1), v_TKD.repeat_interleave(groups, dim=1)
        return varlen_attn(q_THD, k_TKD, v_TKD, offsets_N, offsets_N, max_length, max_length, **extra)

    return run
