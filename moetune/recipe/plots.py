"""PNG plots at the end of a job: loss curves, and tokens per expert in each MoE layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_plots(output_dir: Path, *, moe_layer_ids: list[int]) -> Path | None:
    """Read ``metrics.jsonl`` and write ``plots/loss.png`` (and ``plots/expert_load.png`` when the
    model has experts). Returns the plots directory, or None (with a note) without matplotlib: a
    finished job must not fail on its last, optional output."""
    try:
        import matplotlib
    except ImportError:
        print("metrics.plots: matplotlib is not installed (pip install 'moetune[recipe]'); no plots written",
              file=sys.stderr)  # fmt: skip
        return None

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    plot_dir = output_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per answer token")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot_dir / "loss.png", dpi=120)
    plt.close(fig)

    finals = [r for r in records if r.get("final") and r.get("expert_tokens")]
    if finals:
        counts = finals[-1]["expert_tokens"]  # [MoE layer][expert]
        num_layers, num_experts = len(counts), len(counts[0])
        fig, axes = plt.subplots(num_layers, 1, figsize=(max(6, 0.25 * num_experts), 1.8 * num_layers + 0.6),
                                 squeeze=False, sharex=True)
        for ax, layer_counts, layer_id in zip(axes[:, 0], counts, moe_layer_ids):
            total = max(1, sum(layer_counts))
            ax.bar(range(num_experts), [c / total for c in layer_counts])
            ax.axhline(1 / num_experts, color="gray", linestyle="--", linewidth=1)  # perfectly balanced
            ax.set_ylabel(f"layer {layer_id}")
        axes[-1, 0].set_xlabel("expert (dashed: balanced share)")
        fig.suptitle("share of routed tokens per expert")
        fig.tight_layout()
        fig.savefig(plot_dir / "expert_load.png", dpi=120)
        plt.close(fig)
    return plot_dir
