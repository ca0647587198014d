"""Training-loss curves of bf16 and FP8 fine-tunes side by side, from their metrics.jsonl files.

    python benchmarks/fp8_loss_curves.py bf16=run_bf16/metrics.jsonl fp8=run_fp8/metrics.jsonl --out curves.png
    python benchmarks/fp8_loss_curves.py bf16/seed0=a.jsonl bf16/seed7=b.jsonl fp8/seed0=c.jsonl fp8/seed7=d.jsonl

A label ``SETTING/RUN`` makes the run one of several of that setting (seeds): each setting is then
summarised over its runs. Prints each run's final logged training loss and validation loss and the
mean of its last ``--tail`` logged training losses, with their relative differences to the first
setting's; then, per setting, the mean over its runs of those figures with their range, and each
setting's differences to the first run by run (the same run name: the same seed, hence the same
initial weights, data order and validation split), the comparison with the least noise. The spread
of the first setting's runs (the same precision, another seed) is the yardstick for the others'
differences. Writes the plot (matplotlib) when it is installed: one curve per setting (the mean of
its runs' logged losses, their range shaded).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

Curve = list[tuple[int, float]]


def _read(path: str) -> tuple[Curve, Curve]:
    train, validation = [], []
    for line in Path(path).read_text().splitlines():
        entry = json.loads(line)
        if "loss" in entry:
            train.append((entry["step"], entry["loss"]))
        if "val_loss" in entry:
            validation.append((entry["step"], entry["val_loss"]))
    return train, validation


def _tail_mean(train: Curve, count: int) -> float:
    return statistics.fmean(loss for _, loss in train[-count:])


def _setting(label: str) -> str:
    """The setting of a run label: ``fp8`` for ``fp8/seed7`` (and for ``fp8``)."""
    return label.split("/", 1)[0]


def summarize(runs: dict[str, tuple[Curve, Curve]], tail: int) -> dict[str, dict[str, float]]:
    """Per setting: its number of runs, and the mean, minimum and maximum over them of the mean of the
    last ``tail`` logged losses and of the final validation loss."""
    figures: dict[str, dict[str, list[float]]] = {}
    for label, (train, validation) in runs.items():
        setting = figures.setdefault(_setting(label), {"tail": [], "validation": []})
        setting["tail"].append(_tail_mean(train, tail))
        if validation:
            setting["validation"].append(validation[-1][1])
    return {
        name: {"runs": len(setting["tail"])}
        | {f"{key}_{stat}": fn(values) for key, values in setting.items() if values
           for stat, fn in (("mean", statistics.fmean), ("min", min), ("max", max))}
        for name, setting in figures.items()
    }  # fmt: skip


def paired(runs: dict[str, tuple[Curve, Curve]], tail: int) -> dict[str, dict[str, list[float]]]:
    """Per setting after the first: its runs' relative differences to the first setting's run of the same
    name (``bf16/seed7`` against ``fp8/seed7``: the same seed, so the same initial weights, data order
    and validation split), in the mean of the last ``tail`` logged losses and the final validation loss."""
    first = _setting(next(iter(runs)))
    out: dict[str, dict[str, list[float]]] = {}
    for label, (train, validation) in runs.items():
        setting, _, run = label.partition("/")
        base = runs.get(f"{first}/{run}")
        if setting == first or not run or base is None:
            continue
        diffs = out.setdefault(setting, {"tail": [], "validation": []})
        diffs["tail"].append(_tail_mean(train, tail) / _tail_mean(base[0], tail) - 1)
        if validation and base[1]:
            diffs["validation"].append(validation[-1][1] / base[1][-1][1] - 1)
    return out


def _relative(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.2f}%"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=METRICS_JSONL", help="LABEL: a setting, or SETTING/RUN")
    parser.add_argument("--out", default="loss_curves.png")
    parser.add_argument("--tail", type=int, default=10, help="logged training losses averaged at the end")
    args = parser.parse_args(argv)
    paths = {label: path for label, _, path in (item.partition("=") for item in args.runs)}
    missing = [f"{label}={path}" for label, path in paths.items() if not Path(path).is_file()]
    if missing:
        parser.error(f"no metrics file for {', '.join(missing)} (did that fine-tune run and log any step?)")
    runs = {label: _read(path) for label, path in paths.items()}
    empty = [label for label, (train, _) in runs.items() if not train]
    if empty:
        parser.error(f"no logged training loss in {', '.join(f'{label}={paths[label]}' for label in empty)}")
    first = next(iter(runs))
    base_train, base_val = runs[first][0][-1][1], (runs[first][1][-1][1] if runs[first][1] else None)
    base_tail = _tail_mean(runs[first][0], args.tail)
    for label, (train, validation) in runs.items():
        line = f"{label}: {len(train)} logged points, final train loss {train[-1][1]:.4f} at step {train[-1][0]}"
        line += f" ({_relative(train[-1][1], base_train)} vs {first})"
        tail = _tail_mean(train, args.tail)
        line += f", mean of the last {min(args.tail, len(train))} {tail:.4f} ({_relative(tail, base_tail)})"
        if validation:
            line += f", validation loss {validation[-1][1]:.4f}"
            if base_val:
                line += f" ({_relative(validation[-1][1], base_val)} vs {first})"
        print(line)
    settings = summarize(runs, args.tail)
    if any("/" in label for label in runs):
        base = next(iter(settings.values()))
        for name, figures in settings.items():
            line = f"setting {name}: over {figures['runs']} runs,"
            for key, what in (("tail", f"mean of the last {args.tail}"), ("validation", "final validation loss")):
                if f"{key}_mean" in figures:
                    line += (f" {what} {figures[f'{key}_mean']:.4f} (range {figures[f'{key}_min']:.4f}-"
                             f"{figures[f'{key}_max']:.4f}; {_relative(figures[f'{key}_mean'], base[f'{key}_mean'])}),")  # fmt: skip
            print(line.rstrip(","))
        first = next(iter(settings))
        for name, diffs in paired(runs, args.tail).items():
            line = f"setting {name} against {first}, run by run (same seed), over {len(diffs['tail'])} pairs:"
            for key, what in (("tail", f"mean of the last {args.tail}"), ("validation", "final validation loss")):
                if diffs[key]:
                    values = diffs[key]
                    line += (f" {what} {100 * statistics.fmean(values):+.2f}% on average (range {100 * min(values):+.2f}% to "
                             f"{100 * max(values):+.2f}%),")  # fmt: skip
            print(line.rstrip(","))
    _plot(runs, args.out)


def _plot(runs: dict[str, tuple[Curve, Curve]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    settings: dict[str, list[Curve]] = {}
    for label, (train, _) in runs.items():
        settings.setdefault(_setting(label), []).append(train)
    for name, curves in settings.items():
        steps = sorted(set.intersection(*({step for step, _ in curve} for curve in curves)))
        values = [[dict(curve)[step] for curve in curves] for step in steps]
        (line,) = ax.plot(steps, [statistics.fmean(v) for v in values], label=f"{name} ({len(curves)} run(s), mean)")
        if len(curves) > 1:
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
