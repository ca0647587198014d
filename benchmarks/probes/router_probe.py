"""Fused softmax top-k routing vs torch on Qwen3-30B-A3B router shapes (4096 x 128, top-8, bf16):
how often torch.topk and the kernel agree (ties at the k-th place), and the time of each.

    python benchmarks/probes/router_probe.py
"""
import torch, json
from triton.testing import do_bench
from moetune.kernels.router import softmax_topk, softmax_topk_reference
torch.manual_seed(0)
for scale in (0.5, 0.02, 3.0):
    logits = (torch.randn(4096, 128, device="cuda") * scale).to(torch.bfloat16)
    w, e = softmax_topk(logits, 8, normalize=True, impl="triton")
    wr, er = softmax_topk_reference(logits, 8, True)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    srt = probs.sort(-1, descending=True).values
    tie = srt[:, 7] == srt[:, 8]
    same_set = (e.sort(-1).values == er.sort(-1).values).all(-1)
    same_order = (e == er).all(-1)
    print(json.dumps({"scale": scale, "tie_at_k": tie.float().mean().item(), "same_set": same_set.float().mean().item(),
        "same_set_without_tie": same_set[~tie].float().mean().item(), "same_set_with_tie": same_set[tie].float().mean().item() if tie.any() else None,
        "same_order": same_order.float().mean().item(),
        "weights_maxdiff_same": (w[same_order].float() - wr[same_order].float()).abs().max().item()}))
    # which index does torch pick on a tie?
    if tie.any():
        i = tie.nonzero()[0, 0]
        print("example tie row: torch", er[i].tolist(), "kernel", e[i].tolist())
logits = (torch.randn(4096, 128, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
g = torch.randn(4096, 8, device="cuda", dtype=torch.bfloat16)
def run(impl):
    w, _ = softmax_topk(logits, 8, normalize=True, impl=impl)
    (w * g).sum().backward()
for impl in ("torch", "triton"):
    print(json.dumps({"impl": impl, "fwd_bwd_us": round(do_bench(lambda: run(impl), rep=200) * 1e3, 1),
                      "fwd_us": round(do_bench(lambda: softmax_topk(logits.detach(), 8, normalize=True, impl=impl), rep=200) * 1e3, 1)}))
