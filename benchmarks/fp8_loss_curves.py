"""Training-loss curves of a bf16 and an FP8 fine-tune side by side, from their metrics.jsonl files.

    python benchmarks/fp8_loss_curves.py bf16=run_bf16/metrics.jsonl fp8=run_fp8/metrics.jsonl --out curves.png

Prints each run's final logged training loss and validation loss, and the mean of its last
``--tail`` logged training losses, with their relative differences to the first run's; writes the plot
(matplotlib) when it is installed. Two runs of the first setting with different seeds show how far
one run's end lies from another's without any change of precision: the yardstick for the others.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _read(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    train, validation = [], []
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            train.append((entry["step"], entry["loss"]))
        if "val_loss" in entry:
            validation.append((entry["step"], entry["val_loss"]))
    return train, validation


def _tail_mean(train: list[tuple[int, float]], count: int) -> float:
    last = [loss for _, loss in train[-count:]]
    return sum(last) / len(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=METRICS_JSONL")
    parser.add_argument("--out", default="loss_curves.png")
    parser.add_argument("--tail", type=int, default=10, help="logged training losses averaged at the end")
    args = parser.parse_args()
    paths = {label: path for label, _, path in (item.partition("=") for item in args.runs)}
    missing = [f"{label}={path}" for label, path in paths.items() if not Path(path).is_file()]
    if missing:
        parser.error(f"no metrics file for {', '.join(missing)} (did that fine-tune run and log any step?)")
    runs = {label: _read(path) for label, path in paths.items()}
    first = next(iter(runs))
    base_train, base_val = runs[first][0][-1][1], (runs[first][1][-1][1] if runs[first][1] else None)
    base_tail = _tail_mean(runs[first][0], args.tail)
    for label, (train, validation) in runs.items():
        line = f"{label}: {len(train)} logged points, final train loss {train[-1][1]:.4f} at step {train[-1][0]}"
        line += f" ({100 * (train[-1][1] / base_train - 1):+.2f}% vs {first})"
        tail = _tail_mean(train, args.tail)
        line += f", mean of the last {min(args.tail, len(train))} {tail:.4f} ({100 * (tail / base_tail - 1):+.2f}%)"
        if validation:
            line += f", validation loss {validation[-1][1]:.4f}"
            if base_val:
                line += f" ({100 * (validation[-1][1] / base_val - 1):+.2f}% vs {first})"
        print(line)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (train, validation) in runs.items():
        ax.plot(*zip(*train), label=f"{label} train")
        if validation:
            ax.plot(*zip(*validation), "o--", label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
