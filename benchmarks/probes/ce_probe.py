"""Time the fused cross-entropy gradient kernel (moetune/kernels/cross_entropy.py) per launch setting
(warps, vocabulary block; one program per row) on one
LM-head chunk of Qwen3-30B-A3B: 1766 rows x 151,936 bf16 logits (the chunk the fused loss uses);
plus a copy of the chunk's bytes (read + write) for the ceiling. The kernel reads each row twice and
writes it once.

    python benchmarks/probes/ce_probe.py
"""

from __future__ import annotations

import importlib
import itertools
import json

import torch
from triton.testing import do_bench

ce = importlib.import_module("moetune.kernels.cross_entropy")


def main() -> None:
    rows, vocab = 1766, 151936
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 2
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    normalizer = torch.tensor(4096.0, device="cuda")
    source = torch.empty_like(logits)
    chunk_bytes = logits.numel() * 2
    copy_ms = do_bench(lambda: logits.copy_(source), rep=100)
    print(json.dumps({"what": "copy (read + write of the chunk)", "us": round(copy_ms * 1e3, 1),
                      "tb_per_s": round(2 * chunk_bytes / copy_ms / 1e9, 2)}), flush=True)  # fmt: skip
    source.normal_(std=2.0)
    reference = None
    for warps, block in itertools.product((4, 8, 16), (4096, 8192, 16384)):
        ce._NUM_WARPS, ce._BLOCK_V = warps, block
        logits.copy_(source)
        loss = ce.cross_entropy_grad_(logits, targets, normalizer)
        if reference is None:
            reference = loss.clone()
        ok = torch.allclose(loss, reference, rtol=1e-5, atol=1e-5)
        # In place: later calls read gradients instead of logits (same bytes, finite values).
        ms = do_bench(lambda: ce.cross_entropy_grad_(logits, targets, normalizer), rep=100)
        print(json.dumps({"warps": warps, "block_v": block, "us": round(ms * 1e3, 1),
                          "tb_per_s_3_passes": round(3 * chunk_bytes / ms / 1e9, 2), "loss_matches": ok}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
