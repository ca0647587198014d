"""Results: the printed table, the JSON file (``<model>_<hardware>_<date>.json``) and the PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIDE_NAMES = {"hf": "transformers", "moetune": "moetune"}


def result_stem(*, model: str, hardware: str, date: str) -> str:
    return f"{model}_{hardware}_{date}"


def resolve_out(out: str, stem: str) -> tuple[Path, Path]:
    """``--out`` is a folder (files named by ``stem``) or a ``.json`` path (chart next to it)."""
    path = Path(out)
    json_path = path if path.suffix == ".json" else path / f"{stem}.json"
    return json_path, json_path.with_suffix(".png")


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """moetune / Transformers for every setting both sides ran: throughput speed-up and memory ratios."""
    by_label: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_label.setdefault(row["label"], {})[row["side"]] = row
    out = []
    for label, sides in by_label.items():
        hf, mt = sides.get("hf"), sides.get("moetune")
        if not hf or not mt:
            continue
        out.append(
            {
                "label": label,
                "speedup": _ratio(mt.get("tokens_per_s_per_gpu"), hf.get("tokens_per_s_per_gpu")),
                "peak_ratio": _ratio(mt.get("peak_gib"), hf.get("peak_gib")),
                "working_ratio": _ratio(mt.get("working_gib"), hf.get("working_gib")),
            }
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(data: dict[str, Any]) -> str:
    """One line per (setting, side), the moetune/Transformers ratios on the moetune line."""
    ratios = {c["label"]: c for c in data.get("comparison", [])}
    header = (
        f"{'setting':<24} {'side':<12} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'step ms':>8} "
        f"{'fwd+bwd':>8} {'peak GiB':>9} {'work GiB':>9} {'speed-up':>8} {'peak x':>7}"
    )
    lines = [header, "-" * len(header)]
    for row in data["rows"]:
        if row.get("error"):
            lines.append(f"{row['label']:<24} {SIDE_NAMES[row['side']]:<12} {row['error'][:80]}")
            continue
        ratio = ratios.get(row["label"], {}) if row["side"] == "moetune" else {}
        mfu = row.get("mfu")
        lines.append(
            f"{row['label']:<24} {SIDE_NAMES[row['side']]:<12} {_fmt(row['tokens_per_s_per_gpu'], ',.0f'):>10} "
            f"{_fmt(row['tflops_per_gpu'], '.1f'):>8} {_fmt(None if mfu is None else 100 * mfu, '.1f'):>6} "
            f"{_fmt(1e3 * row['step_s'], '.1f'):>8} {_fmt(1e3 * row['fwd_bwd_s'], '.1f'):>8} "
            f"{_fmt(row.get('peak_gib'), '.1f'):>9} {_fmt(row.get('working_gib'), '.1f'):>9} "
            f"{_fmt(ratio.get('speedup'), '.2f'):>8} {_fmt(ratio.get('peak_ratio'), '.2f'):>7}"
        )
    return "\n".join(lines)


def format_header(data: dict[str, Any]) -> str:
    v = data["versions"]
    peak = data.get("matmul_peak_tflops")
    return (
        f"{data['model']} ({data['config']['layers']} layers) on {data['world_size']} x {data['gpu']} | "
        f"torch {v['torch']}, transformers {v['transformers']}, triton {v['triton']} | "
        f"{data['flops_per_token'] / 1e9:.2f} GFLOP/token | bf16 matmul peak "
        f"{'-' if peak is None else f'{peak:.0f} TFLOP/s'} | commit {str(data['commit'].get('commit'))[:12]}"
    )


def format_parity(parity: dict[str, Any] | None) -> str:
    if not parity:
        return "parity: not run"
    status = "PASS" if parity["passed"] else "FAIL"
    parts = [
        f"{m} hf {c['hf_error']:.2e} moetune {c['moetune_error']:.2e} {'ok' if c['passed'] else 'FAIL'}"
        for m, c in parity["checks"].items()
    ]
    setup = parity["setup"]
    return f"parity vs fp32 ({setup['layers']} layers, {setup['routing']} routing): {status} | " + " | ".join(parts)


def write_chart(data: dict[str, Any], path: Path) -> bool:
    """Grouped bars of tokens/s/GPU and peak GiB per setting; False if matplotlib is missing or
    no setting ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in data["rows"] if not r.get("error")]
    if not rows:
        return False
    labels = list(dict.fromkeys(r["label"] for r in rows))
    sides = [s for s in ("hf", "moetune") if any(r["side"] == s for r in rows)]
    value = {(r["label"], r["side"]): r for r in rows}
    panels = [("tokens_per_s_per_gpu", "tokens/s/GPU")]
    if any(r.get("peak_gib") is not None for r in rows):  # no allocator statistics off CUDA
        panels.append(("peak_gib", "peak GiB"))
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * max(4, 1.1 * len(labels) + 2), 4.5), squeeze=False)
    width = 0.8 / max(len(sides), 1)
    for ax, (key, title) in zip(axes[0], panels):
        for i, side in enumerate(sides):
            xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(labels))]
            ys = [(value.get((label, side)) or {}).get(key) or 0.0 for label in labels]
            bars = ax.bar(xs, ys, width, label=SIDE_NAMES[side])
            ax.bar_label(bars, fmt="%.0f" if key.startswith("tokens") else "%.1f", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['model']} on {data['world_size']} x {data['gpu']} ({data['date']})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarize(paths: list[str]) -> str:
    """Compact tables of several result files (the last thing the GPU script prints)."""
    blocks = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "rows" in data:
            parity = format_parity(data.get("parity"))
            blocks.append("\n".join([f"== {Path(path).name}", format_header(data), parity, format_table(data)]))
        elif "probe" in data:
            blocks.append(f"== {Path(path).name}\n" + format_probe(data))
        elif "parity" in data:
            blocks.append(f"== {Path(path).name}\n" + format_parity(data["parity"]))
    return "\n\n".join(blocks)


def format_probe(data: dict[str, Any]) -> str:
    lines = [f"longest sequence that trains one full step ({data['model']}, {data['config']['layers']} layers):"]
    for side, result in data["probe"].items():
        lines.append(
            f"  {SIDE_NAMES[side]:<12} {_fmt(result.get('longest'), ',d'):>8} tokens "
            f"(first failure: {_fmt(result.get('first_failure'), ',d')}; AC {result.get('activation_checkpointing')})"
        )
    return "\n".join(lines)
