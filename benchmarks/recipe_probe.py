"""The fine-tuning recipe's own throughput on GPUs: `moetune finetune` variants on one synthetic
packed dataset, each in a fresh process, compared by the tokens/s/GPU the recipe logs.

What it answers: how fast users of the recipe train (not the bench's step alone): eager against
replayed from CUDA graphs (``training.cuda_graph``), and, with ``--baseline-root``, against another
source tree (an earlier commit) on the same data. The dataset holds chat rows of random lengths
(``--min-chars`` .. ``--max-chars`` digits and spaces, the shipped tokenizer: ~1 token per
character), packed into ``--max-length`` rows. The model is Qwen3-30B-A3B's shape (or another
shipped bench config, ``--model-config``) with ``--layers`` layers, random init, bf16 weights and
AdamW states, as the bench's rows.

Per variant: the median tokens/s/GPU over the logged windows after ``--skip-steps``, peak memory,
the first losses (the graphed and eager losses of one commit must agree to bf16 noise).

    python benchmarks/recipe_probe.py --layers 8 --variants eager,graph --out benchmarks/results
    python benchmarks/recipe_probe.py --layers 16 --nproc 2 --ep 2 --variants eager,graph
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "qwen3_30b_a3b"


def write_data(path: Path, *, rows: int, min_chars: int, max_chars: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            n = rng.randint(min_chars, max_chars)
            text = "".join(rng.choice("0123456789 ") for _ in range(n))
            cut = rng.randint(n // 4, 3 * n // 4)
            f.write(json.dumps({"prompt": text[:cut], "answer": text[cut:]}) + "\n")


def write_model_config(path: Path, layers: int, source: str) -> str:
    """The first ``layers`` layers of ``source`` (a shipped bench config's name, a config.json or a
    folder; per-layer lists such as Nemotron-H's pattern cut with them) written to ``path``; returns
    the config's short name for the result file."""
    sys.path.insert(0, str(ROOT))  # this tree's moetune, as the variants get through PYTHONPATH
    from moetune.bench.models import load_config

    name, config = load_config(source, layers=layers)
    config.save_pretrained(path)
    return name


def run_variant(name: str, *, root: Path, args: argparse.Namespace, work: Path) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: an earlier run's lines would mix in
    overrides = {
        "model.config_path": work / "model", "data.train_path": work / "train.jsonl", "data.test_path": "",
        "data.max_length": args.max_length, "data.val_fraction": 0, "training.steps": args.steps,
        "training.micro_batch_size": 1, "training.precision": "bf16", "training.output_dir": out,
        "training.val_every": 0, "training.num_threads": 0, "metrics.log_every": args.log_every,
        "metrics.progress_bar": "false", "metrics.plots": "false", "checkpoint.export_final": "false",
        "optim.lr": 1e-5, "optim.warmup_steps": 5,
    }
    if args.ep > 1:
        overrides.update({"distributed.ep_size": args.ep, "distributed.ep_dispatch": "allgather",
                          "distributed.dense_parallel": "replicate"})
    # explicit both ways: the default "auto" graphs LoRA runs
    overrides["training.cuda_graph"] = "true" if name.endswith("graph") else "false"
    overrides.update(dict(item.split("=", 1) for item in args.override))
    command = [sys.executable, "-m", "moetune.cli", "finetune"]
    if args.nproc > 1:
        command += ["--nproc-per-node", str(args.nproc)]
    for key, value in overrides.items():
        command += [f"--{key}", str(value)]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.time()
    # Its own process session (setsid), so that a timeout stops torchrun's workers too.
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    # A SIGTERM to this probe (an outer `timeout`) must stop the run too: it sits in a process session of its
    # own and would otherwise keep the GPU's memory through the next variant (an OOM there).
    previous = signal.signal(signal.SIGTERM, _raise_timeout)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc, out)
        output, _ = proc.communicate()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            _stop(proc, out)
    result = {"variant": name, "source": str(root), "returncode": proc.returncode, "wall_s": round(time.time() - start, 1)}
    (args.out / f"recipe_probe_{name}.log").write_text(output)
    if (out / "profile").is_dir():  # metrics.profile_start given through --override
        shutil.copytree(out / "profile", args.out / f"recipe_profile_{name}", dirs_exist_ok=True)
    if proc.returncode != 0:
        result["error_tail"] = output[-6000:]
        if not (out / "metrics.jsonl").is_file():
            return result
        # Stopped by the timeout (or failed) after logging some windows: what it logged still counts.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if "tokens_per_s_per_gpu" in r and r["step"] > args.skip_steps]
    rates = [r["tokens_per_s_per_gpu"] for r in windows]
    result.update({
        "tokens_per_s_per_gpu": statistics.median(rates) if rates else None,
        "windows": rates, "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in windows) if windows else None,
        "peak_mem_gib": max(r["peak_mem_gib"] for r in windows) if windows else None,
        "losses": [r["loss"] for r in records if "loss" in r][:6],
        "sharding": next((r["sharding"] for r in records if "sharding" in r), None),
    })
    return result


def _raise_timeout(signum, frame) -> None:
    raise subprocess.TimeoutExpired("recipe_probe", 0)


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """Kill the run's process session and, since torchrun starts its workers in process sessions of
    their own, every process naming the run's output directory."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    subprocess.run(["pkill", "-9", "-f", str(out)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model-config", default=CONFIG,
                        help="a shipped bench config (qwen3_30b_a3b, nemotron_3_nano_30b_a3b, gpt_oss_20b, "
                             "moonlight_16b_a3b), a config.json or a folder (a tiny one for a CPU smoke test)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--variants", default="eager,graph",
                        help="comma list: eager, graph (this tree); base-eager, base-graph (--baseline-root)")
    parser.add_argument("--baseline-root", type=Path, default=None)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe setting for every variant, e.g. metrics.profile_start=20 (repeatable)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--min-chars", type=int, default=200)
    parser.add_argument("--max-chars", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--skip-steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moetune_recipe_probe"))
    args = parser.parse_args()
    for item in args.override:
        if "=" not in item:
            parser.error(f"--override wants KEY=VALUE (e.g. metrics.profile_start=20), got {item!r}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.nproc * (args.steps + 5) * max(1, args.max_length // ((args.min_chars + args.max_chars) // 2)) * 2
    write_data(args.work / "train.jsonl", rows=rows, min_chars=args.min_chars, max_chars=args.max_chars, seed=0)
    model_name = write_model_config(args.work / "model", args.layers, args.model_config)
    results = []
    for name in args.variants.split(","):
        root = args.baseline_root if name.startswith("base-") else ROOT
        if root is None:
            raise SystemExit(f"variant {name} needs --baseline-root")
        result = run_variant(name, root=root, args=args, work=args.work)
        print(json.dumps({k: v for k, v in result.items() if k != "windows"}), flush=True)
        results.append(result)
    import torch

    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": os.environ.get("MOETUNE_COMMIT", "unknown"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()}, "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"recipe_{model_name}-{args.layers}l_{args.nproc}gpu_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    (args.out / name).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
