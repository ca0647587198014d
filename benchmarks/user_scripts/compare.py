"""Run the user scripts side by side: each script twice, ``--import-from transformers`` and
``--import-from moetune``, one process per side, from the same checkpoint and tokens, and write
tokens/s, peak memory and the first losses of both sides to one JSON file.

    python benchmarks/user_scripts/compare.py --config qwen3_30b_a3b --layers 8 --out benchmarks/results/DIR
    python benchmarks/user_scripts/compare.py --cpu --scripts trainer_rows,sft_padded   # tiny, fp32 (the tests)

The checkpoint: the config (a shipped one, ``moetune/assets/configs``, or a config.json) with
``--layers`` layers, initialised from ``--seed`` by Transformers and saved in Hugging Face format with
moetune's small default tokenizer (its pad token; the token ids are random over the model's
vocabulary). The tokens: ``rows.jsonl`` (rows of ``--seq-len`` random ids) for the Trainer scripts,
``chat.jsonl`` (samples of ``--chat-lengths`` random ids) for the TRL ones. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
DEFAULT_TOKENIZER = REPO_ROOT / "moetune" / "assets" / "default" / "tokenizer"


@dataclass(frozen=True)
class Script:
    file: str
    data: str  # "rows" or "chat"
    flags: tuple[str, ...] = ()
    sides: tuple[str, ...] = ("transformers", "moetune")
    batch_size: str = "1"  # per_device_train_batch_size, or "chat" for --chat-batch-size
    baseline: str | None = None
    """A script whose sides this one is compared with, for a variant that changes only moetune's side
    (its Transformers side would be the baseline's, run again)."""


SCRIPTS: dict[str, Script] = {
    "trainer_rows": Script("trainer_rows.py", "rows"),
    "sft_padded": Script("sft_chat.py", "chat", batch_size="chat"),
    "sft_packing": Script("sft_chat.py", "chat", ("--packing",)),
    "sft_padding_free": Script("sft_chat.py", "chat", ("--padding-free",), batch_size="chat"),
    "sft_lora": Script("sft_lora.py", "chat", ("--packing",)),
    # Script 5: script 1 with `from moetune import Trainer` as well.
    "trainer_rows_moetune_trainer": Script("trainer_rows.py", "rows", ("--moetune-trainer",), sides=("moetune",),
                                           baseline="trainer_rows"),  # fmt: skip
    # TrainingArguments(torch_compile=True) on moetune's side, against its eager trainer_rows.
    "trainer_rows_compile": Script("trainer_rows.py", "rows", ("--torch-compile",), sides=("moetune",), baseline="trainer_rows"),
    # Script 1 with the one setting docs/trainer_and_trl.md suggests, on both sides:
    # TrainingArguments(accelerator_config={"non_blocking": True}).
    "trainer_rows_non_blocking": Script("trainer_rows.py", "rows", ("--non-blocking",)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3_30b_a3b", help="a shipped config name or a config.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--scripts", default="trainer_rows,sft_padded,sft_packing,sft_padding_free,sft_lora,trainer_rows_moetune_trainer",
                        help=f"comma-separated, of {', '.join(SCRIPTS)}")  # fmt: skip
    parser.add_argument("--sides", default="transformers,moetune")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=15)
    parser.add_argument("--seq-len", type=int, default=4096, help="rows' length; SFT's max_length (packing)")
    parser.add_argument("--chat-lengths", default="200,3000", help="chat samples' lengths: uniform in [min, max]")
    parser.add_argument("--chat-batch-size", type=int, default=2, help="per_device_train_batch_size of unpacked SFT")
    parser.add_argument("--num-chat", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="folder for the JSON result and the logs")
    parser.add_argument("--work", default=None, help="folder for the checkpoint and data (default: OUT/work, removed after)")
    parser.add_argument("--cpu", action="store_true", help="fp32 on the CPU (a tiny config unless --config says otherwise)")
    parser.add_argument("--in-process", action="store_true", help="run the scripts in this process (tests; CPU only)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per side")
    parser.add_argument("--extra", action="append", default=[], help="more arguments for every script, e.g. --extra=--lora-rank=8")
    args = parser.parse_args(argv)
    unknown = [name for name in args.scripts.split(",") if name not in SCRIPTS]
    if unknown:
        parser.error(f"unknown scripts {unknown}; known: {', '.join(SCRIPTS)}")
    return args


def build_checkpoint(folder: Path, *, config_name: str, layers: int, seed: int, cpu: bool) -> dict[str, Any]:
    """A randomly initialised checkpoint in Hugging Face format with the default tokenizer."""
    import torch
    import transformers

    from moetune.bench.models import load_config

    name, config = load_config(config_name, layers=layers)
    config.use_cache = False
    torch.manual_seed(seed)
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, save_original_format=False)  # experts fused: the fastest layout to write and read
    for file in DEFAULT_TOKENIZER.iterdir():
        shutil.copy(file, folder / file.name)
    info = {"name": name, "model_type": config.model_type, "layers": layers, "vocab_size": config.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return info


def write_rows(path: Path, *, count: int, length: int, vocab_size: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"input_ids": [rng.randrange(vocab_size) for _ in range(length)]}) + "\n")


def write_chat(path: Path, *, count: int, lengths: tuple[int, int], vocab_size: int, seed: int) -> None:
    rng = random.Random(seed + 1)
    with path.open("w") as out:
        for _ in range(count):
            length = rng.randint(*lengths)
            out.write(json.dumps({"input_ids": [rng.randrange(vocab_size) for _ in range(length)]}) + "\n")


def script_argv(name: str, side: str, args: argparse.Namespace, work: Path, out: Path) -> list[str]:
    script = SCRIPTS[name]
    batch = str(args.chat_batch_size) if script.batch_size == "chat" else script.batch_size
    argv = [
        "--import-from", side, "--checkpoint", str(work / "checkpoint"), "--data", str(work / f"{script.data}.jsonl"),
        "--output-dir", str(work / "runs" / name / side), "--result", str(out / "sides" / f"{name}.{side}.json"),
        "--max-steps", str(args.max_steps), "--warmup-steps", str(args.warmup_steps), "--batch-size", batch,
        "--max-length", str(args.seq_len), "--seed", str(args.seed), *script.flags, *args.extra,
    ]  # fmt: skip
    return [*argv, "--cpu"] if args.cpu else argv


def run_side(name: str, side: str, args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    script = HERE / SCRIPTS[name].file
    argv = script_argv(name, side, args, work, out)
    result = out / "sides" / f"{name}.{side}.json"
    result.unlink(missing_ok=True)
    log = out / "logs" / f"{name}.{side}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    error = None
    if args.in_process:
        error = _run_in_process(script, argv)
    else:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
        try:
            with log.open("w") as handle:
                done = subprocess.run([sys.executable, str(script), *argv], stdout=handle, stderr=subprocess.STDOUT,
                                      env=env, timeout=args.timeout, cwd=str(HERE), check=False)  # fmt: skip
            if done.returncode != 0:
                error = f"exit code {done.returncode}: " + _tail(log)
        except subprocess.TimeoutExpired:
            error = f"timed out after {args.timeout} s: " + _tail(log)
    wall = time.perf_counter() - started
    if error is None and not result.is_file():
        error = "no result written: " + (_tail(log) if log.is_file() else "")
    if error is not None:
        return {"error": error, "wall_s": wall}
    return {**json.loads(result.read_text()), "wall_s": wall}


def _run_in_process(script: Path, argv: list[str]) -> str | None:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except Exception as error:  # noqa: BLE001 -- reported in the result like a failed process
        return f"{type(error).__name__}: {error}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None


def _tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def compare_sides(sides: dict[str, dict[str, Any]], *, first: int = 10) -> dict[str, Any]:
    """Ratios (moetune over Transformers) and the agreement of the first ``first`` losses."""
    hf, ours = sides.get("transformers"), sides.get("moetune")
    if not hf or not ours or "error" in hf or "error" in ours:
        return {}
    summary: dict[str, Any] = {}
    for key in ("tokens_per_s_median", "tokens_per_s_mean"):
        if hf.get(key) and ours.get(key):
            summary[key.replace("tokens_per_s", "speedup")] = ours[key] / hf[key]
    for key in ("peak_memory_gib", "peak_reserved_gib"):
        if hf.get(key) and ours.get(key):
            summary[key.replace("_gib", "_ratio")] = ours[key] / hf[key]
    pairs = list(zip(hf["losses"][:first], ours["losses"][:first]))
    if pairs:
        summary["loss_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
        summary["loss_max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
    return summary


def environment(cpu: bool) -> dict[str, Any]:
    import torch

    from moetune.bench.env import commit, gpu_name, versions

    extra = {}
    for package in ("trl", "peft", "datasets", "accelerate"):
        with contextlib.suppress(ImportError):
            extra[package] = __import__(package).__version__
    device = torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    return {"gpu": gpu_name(device), "versions": {**versions(), **extra}, "commit": commit()}


def main(argv: list[str] | None = None) -> int:
    from moetune.bench.env import utc_now

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "work"
    config = "tiny" if args.cpu and args.config == "qwen3_30b_a3b" else args.config
    started = time.perf_counter()
    checkpoint = build_checkpoint(work / "checkpoint", config_name=config, layers=args.layers, seed=args.seed, cpu=args.cpu)
    scripts = args.scripts.split(",")
    num_rows = args.max_steps * max(1, args.chat_batch_size)
    if any(SCRIPTS[s].data == "rows" for s in scripts):
        write_rows(work / "rows.jsonl", count=num_rows, length=args.seq_len, vocab_size=checkpoint["vocab_size"], seed=args.seed)
    if any(SCRIPTS[s].data == "chat" for s in scripts):
        low, high = (int(x) for x in args.chat_lengths.split(","))
        write_chat(work / "chat.jsonl", count=args.num_chat, lengths=(low, high), vocab_size=checkpoint["vocab_size"], seed=args.seed)
    prepared_s = time.perf_counter() - started
    report: dict[str, Any] = {
        "date": utc_now().isoformat(), **environment(args.cpu), "checkpoint": checkpoint,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")}, "prepare_s": prepared_s, "scripts": {},
    }  # fmt: skip
    wanted_sides = args.sides.split(",")
    for name in scripts:
        sides = {side: run_side(name, side, args, work, out) for side in SCRIPTS[name].sides if side in wanted_sides}
        entry = report["scripts"][name] = {"sides": sides}
        baseline = report["scripts"].get(SCRIPTS[name].baseline or "", {}).get("sides", {})
        if baseline.get("transformers") and "moetune" in sides:
            # against the baseline's Transformers side, and its moetune side (import only)
            entry.update(compare_sides({"transformers": baseline["transformers"], "moetune": sides["moetune"]}))
            entry["baseline"] = SCRIPTS[name].baseline
            entry["vs_import_only"] = compare_sides({"transformers": baseline.get("moetune", {}), "moetune": sides["moetune"]})
        else:
            entry.update(compare_sides(sides))
        _write(out, report, checkpoint)
        print(_line(name, report["scripts"][name]), flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    path = _write(out, report, checkpoint)
    print(f"wrote {path}")
    return 0 if all("error" not in side for entry in report["scripts"].values() for side in entry["sides"].values()) else 1


def _write(out: Path, report: dict[str, Any], checkpoint: dict[str, Any]) -> Path:
    path = out / f"user_scripts_{checkpoint['name']}-{checkpoint['layers']}l.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def _line(name: str, entry: dict[str, Any]) -> str:
    cells = []
    for side, result in entry["sides"].items():
        if "error" in result:
            cells.append(f"{side}: ERROR {result['error'].splitlines()[-1][:160] if result['error'] else ''}")
        else:
            peak = result.get("peak_memory_gib")
            cells.append(f"{side}: {result['tokens_per_s_median'] or 0:,.0f} tok/s (mean {result['tokens_per_s_mean'] or 0:,.0f})"
                         + (f", {peak:.1f} GiB" if peak else "")
                         + (f", {result['graph_replays']} graph replays" if result.get("graph_replays") is not None else "")
                         + (f" (eager: {result['graph_eager_reason']})" if result.get("graph_eager_reason") else "")
                         + _phases(result.get("phases_ms_median"))
                         + _profiled(result.get("profile")))  # fmt: skip
    if "speedup_median" in entry:
        cells.append(f"x{entry['speedup_median']:.2f} (mean x{entry['speedup_mean']:.2f}), loss diff {entry['loss_max_abs_diff']:.2e}")
    return f"{name}: " + " | ".join(cells)


def _profiled(profile: dict[str, Any] | None) -> str:
    """" {profiled step: GPU busy 80.1 of 85.3 ms}": the profiled step's timeline, when there was one."""
    if not profile or "timeline_span_ms" not in profile:
        return ""
    return f" {{profiled step: GPU busy {profile['timeline_busy_ms']:.1f} of {profile['timeline_span_ms']:.1f} ms}}"


def _phases(phases: dict[str, float | None] | None) -> str:
    """" [forward 30.1 + backward_and_clip 60.2 + ... ms]": the GPU time of a step's phases (medians)."""
    if not phases or any(ms is None for ms in phases.values()):
        return ""
    return " [" + " + ".join(f"{name} {ms:.1f}" for name, ms in phases.items()) + " ms]"


if __name__ == "__main__":
    sys.exit(main())
