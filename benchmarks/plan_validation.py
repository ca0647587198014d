"""``moetune plan`` against measurements: the recorded results (any machine) or new ones (one GPU).

    python benchmarks/plan_validation.py --recorded                 # CPU is enough: benchmarks/results/ files
    python benchmarks/plan_validation.py --out DIR                  # one H100 / H200, ~6-8 min: measure, compare

Recorded: every one-GPU and two-GPU row of benchmarks/results/ the planner is checked against (the
files are read here; the ones its calibration was fitted to are marked ``fitted``).

Measured (``--out``): for each family (Qwen3-30B-A3B, GPT-OSS-20B, Moonlight-16B-A3B for DeepSeek-V3's
architecture, Nemotron 3 Nano) a few layers, full fine-tuning, eager steps (moetune's AdamW, real
routing), at sequence lengths 4k-64k with activation checkpointing off, full and selective; peak
memory (``max_memory_allocated`` after warm-up), the memory each forward leaves for the backward
(the activations the planner counts per layer) and step time next to the planner's prediction for
the same setting on this GPU. One JSON line per setting on stdout (and in DIR/plan_validation.jsonl),
then a table. A global time budget (``--budget``) skips what is left rather than overrunning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moetune.plan.validation import Measured, predict


HOST_BOUND = "eager LoRA: host-bound step time, not modelled"
STALE = "commit 369c3fc: before this family's later kernels (its one-GPU step 1.2-1.3x faster since)"

# (the results file, which row, the setting) -- the numbers are read from the file.
RECORDED = [
    # One H200, graphed steps, seq 4096 (the recipe's fastest full fine-tuning path).
    ("benchmarks/results/h200_20261201_25717d9/qwen3-30b-a3b-8l_h200_20261201T033911Z.json", "real", dict(model="qwen3_30b_a3b", layers=8, gpu="h200", cuda_graph=True, fitted=("membound_traffic", "cuda_graph_pool_factor"))),
    ("benchmarks/results/h200_20261204_75498da/qwen3-30b-a3b-16l_h200_20261204T192325Z.json", "real", dict(model="qwen3_30b_a3b", layers=16, gpu="h200", cuda_graph=True)),
    ("benchmarks/results/h200_20261201_fcb068d/gpt-oss-20b-6l_h200_20261201T044518Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h200", cuda_graph=True, fitted=("cuda_graph_pool_factor",))),
    ("benchmarks/results/h200_20261201_fcb068d/moonlight-16b-a3b-8l_h200_20261201T044703Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h200", cuda_graph=True, fitted=("cuda_graph_pool_factor",))),
    ("benchmarks/results/h200_20261201_71b6702/nemotron-3-nano-30b-a3b-8l_h200_20261201T044109Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h200", cuda_graph=True, fitted=("mamba_scan_us_per_token", "cuda_graph_pool_factor"))),
    # One H200, eager steps (Qwen3's last eager one-GPU run predates later kernels: 2026-12-01, commit 25717d9).
    ("benchmarks/results/h200_20261201_25717d9/gpt-oss-20b-6l_h200_20261201T033744Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h200")),
    ("benchmarks/results/h200_20261201_25717d9/moonlight-16b-a3b-8l_h200_20261201T033810Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h200", fitted=("eager_idle_ms_per_layer",))),
    ("benchmarks/results/h200_20261201_3afe87d/nemotron-3-nano-30b-a3b-8l_h200_20261201T035816Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h200")),
    # One H100 (another card: its own calibration file, nothing fitted there).
    ("benchmarks/results/h100_20261205_5b44751/qwen3-30b-a3b-8l_h100_20261205T072731Z.json", "real", dict(model="qwen3_30b_a3b", layers=8, gpu="h100", cuda_graph=True)),
    ("benchmarks/results/h100_20261205_5b44751/gpt-oss-20b-6l_h100_20261205T071710Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h100", cuda_graph=True)),
    ("benchmarks/results/h100_20261205_7c26750/moonlight-16b-a3b-8l_h100_20261205T074239Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h100", cuda_graph=True, note="commit 7c26750: router GEMM change, reverted")),
    ("benchmarks/results/h100_20261205_5b44751/nemotron-3-nano-30b-a3b-8l_h100_20261205T072001Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h100", cuda_graph=True)),
    # One H200, LoRA rank 16, graphed (the recipe's default for LoRA on one GPU): step time.
    ("benchmarks/results/h200_20261201_2aa9b59/lora16_graph_qwen3-30b-a3b-8l_h200_20261201T063437Z.json", "real", dict(model="qwen3_30b_a3b", layers=8, gpu="h200", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h200_20261201_0a767b4/lora16_graph_gpt-oss-20b-6l_h200_20261201T064124Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h200", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h200_20261201_0a767b4/lora16_graph_moonlight-16b-a3b-8l_h200_20261201T064054Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h200", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h200_20261201_0a767b4/lora16_graph_nemotron-3-nano-30b-a3b-8l_h200_20261201T064155Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h200", lora_rank=16, cuda_graph=True)),
    # One H100, LoRA rank 16, graphed, and Nemotron 3 Nano's full fine-tuning next to it (2026-12-08, commit d0bda59).
    ("benchmarks/results/h100_20261208_d0bda59/qwen3-30b-a3b-8l_h100_20261208T002913Z.json", "real", dict(model="qwen3_30b_a3b", layers=8, gpu="h100", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h100_20261208_d0bda59/gpt-oss-20b-6l_h100_20261208T003052Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h100", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h100_20261208_d0bda59/moonlight-16b-a3b-8l_h100_20261208T003112Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h100", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h100_20261208_d0bda59/nemotron-3-nano-30b-a3b-8l_h100_20261208T002839Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h100", lora_rank=16, cuda_graph=True)),
    ("benchmarks/results/h100_20261208_d0bda59/nemotron-3-nano-30b-a3b-8l_h100_20261208T003001Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h100", cuda_graph=True)),
    # One H200, LoRA rank 16, eager: the working memory (peak - state) is activations. (Eager LoRA
    # steps wait for the host, benchmarks/README.md, 2026-12-01, commit 82e97e6; the planner does not model it.)
    ("benchmarks/results/h200_20261201_65f2cf5/lora16_qwen3-30b-a3b-8l_h200_20261201T062933Z.json", "real", dict(model="qwen3_30b_a3b", layers=8, gpu="h200", lora_rank=16, note=HOST_BOUND)),
    ("benchmarks/results/h200_20261201_2aa9b59/lora16_gpt-oss-20b-6l_h200_20261201T063508Z.json", "real", dict(model="gpt_oss_20b", layers=6, gpu="h200", lora_rank=16, note=HOST_BOUND)),
    ("benchmarks/results/h200_20261201_2aa9b59/lora16_moonlight-16b-a3b-8l_h200_20261201T063638Z.json", "real", dict(model="moonlight_16b_a3b", layers=8, gpu="h200", lora_rank=16, note=HOST_BOUND)),
    ("benchmarks/results/h200_20261201_2aa9b59/lora16_nemotron-3-nano-30b-a3b-8l_h200_20261201T063535Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=8, gpu="h200", lora_rank=16, note=HOST_BOUND)),
    # Two H200s, ep=2 (rows B and its siblings).
    ("benchmarks/results/2xh200_20261201_369c3fc/qwen3-30b-a3b-16l_2xh200_20261201T020527Z.json", "real", dict(model="qwen3_30b_a3b", layers=16, gpu="h200", world=2, cuda_graph=True, dense_parallel="replicate", ep_dispatch="allgather")),
    ("benchmarks/results/2xh200_20261201_369c3fc/moonlight-16b-a3b-16l_2xh200_20261201T020415Z.json", "real", dict(model="moonlight_16b_a3b", layers=16, gpu="h200", world=2, cuda_graph=True, dense_parallel="replicate", ep_dispatch="allgather")),
    ("benchmarks/results/2xh200_20261201_369c3fc/gpt-oss-20b-12l_2xh200_20261201T020451Z.json", "real", dict(model="gpt_oss_20b", layers=12, gpu="h200", world=2, cuda_graph=True, dense_parallel="replicate", ep_dispatch="allgather", note=STALE)),
    ("benchmarks/results/2xh200_20261201_369c3fc/nemotron-3-nano-30b-a3b-16l_2xh200_20261201T020308Z.json", "real", dict(model="nemotron_3_nano_30b_a3b", layers=16, gpu="h200", world=2, cuda_graph=True, dense_parallel="replicate", ep_dispatch="allgather", note=STALE)),
    ("benchmarks/results/2xh200_20261130_366db78/qwen3-30b-a3b-16l_2xh200_20261130T185743Z.json", "real", dict(model="qwen3_30b_a3b", layers=16, gpu="h200", world=2, dense_parallel="replicate", ep_dispatch="allgather", fitted=("eager_host_ms_per_layer",))),
    ("benchmarks/results/2xh200_20261130_366db78/qwen3-30b-a3b-16l_2xh200_20261130T185914Z.json", "real", dict(model="qwen3_30b_a3b", layers=16, gpu="h200", world=2, fitted=("eager_host_ms_per_layer",), note="reduce_dtype bfloat16")),
]

# The longest-sequence probes: one step per length, activation checkpointing (full) on.
PROBES = [
    ("benchmarks/results/h200_20261130_1d2f8a8/qwen3-30b-a3b-8l-probe_h200_20261130T033053Z.json", dict(model="qwen3_30b_a3b", layers=8)),
    ("benchmarks/results/h200_20261201_4e42218/gpt-oss-20b-6l-probe_h200_20261201T104821Z.json", dict(model="gpt_oss_20b", layers=6)),
    ("benchmarks/results/h200_20261201_4e42218/moonlight-16b-a3b-8l-probe_h200_20261201T105836Z.json", dict(model="moonlight_16b_a3b", layers=8)),
    ("benchmarks/results/h200_20261201_4e42218/nemotron-3-nano-30b-a3b-8l-probe_h200_20261201T105010Z.json", dict(model="nemotron_3_nano_30b_a3b", layers=8)),
    ("benchmarks/results/h200_20261201_03fcd1c/nemotron-3-nano-30b-a3b-8l-probe_h200_20261201T111833Z.json", dict(model="nemotron_3_nano_30b_a3b", layers=8)),
]


# Measured by this script on one GPU (``--out``): eager steps, 4-6 layers, seq 4k-64k, recompute none / full /
# selective. The calibration constants fitted to a setting are named with it.
MEASURED_FILES = [
    ("benchmarks/results/h100_20261207_aa8c3d1/plan/plan_validation.jsonl", "aa8c3d1", {
        ("qwen3_30b_a3b", 65536, "none"): ("attention_tflops",),
        ("gpt_oss_20b", 65536, "none"): ("attention_tflops",),
        ("moonlight_16b_a3b", 65536, "none"): ("attention_tflops",),
        ("nemotron_3_nano_30b_a3b", 16384, "none"): ("mamba_scan_us_per_token",),
    }, {}),
    # Nemotron-H again, without recompute, with the memory each forward leaves for the backward (forward_saved_gib).
    ("benchmarks/results/h100_20261207_3690952/plan/plan_validation.jsonl", "3690952", {
        ("nemotron_3_nano_30b_a3b", 16384, "none"): ("mamba_scan_us_per_token",),
    }, {}),
]


def recorded_measurements() -> list[Measured]:
    out = []
    for path, commit, fitted, memory_notes in MEASURED_FILES:
        for line in (REPO / path).read_text().splitlines():
            fields = json.loads(line)["measured"]
            key = (fields["model"], fields["seq_len"], fields["recompute"])
            fields.update(source=f"{path} ({commit})", fitted=fitted.get(key, ()), memory_note=memory_notes.get(key, ""))
            out.append(Measured(**fields))
    for path, routing, fields in RECORDED:
        data = json.loads((REPO / path).read_text())
        row = next(r for r in data["rows"] if r["side"] == "moetune" and r["routing"] == routing and not r.get("error"))
        out.append(Measured(step_s=row["step_s"], peak_gib=row["peak_gib"], reserved_gib=row["reserved_gib"],
                            state_gib=row["state_gib"], seq_len=row["seq_len"], micro_batch=row["micro_batch"],
                            source=f"{path} ({data.get('commit', {}).get('commit', '?')[:7]})", **fields))
    for path, fields in PROBES:
        data = json.loads((REPO / path).read_text())
        for attempt in data["probe"].get("moetune", {}).get("attempts", []):
            if attempt.get("status") != "ok" or attempt["seq_len"] < 65536:
                continue
            out.append(Measured(gpu="h200", seq_len=attempt["seq_len"], recompute="full", peak_gib=attempt["peak_gib"],
                                reserved_gib=attempt["reserved_gib"], first_step=True,
                                fitted=("activation_transient_fraction",),
                                source=f"{path} ({data.get('commit', {}).get('commit', '?')[:7]})", **fields))
    return out


def table(rows: list[dict]) -> str:
    head = ("| model (layers) | GPUs | seq | recompute | LoRA | graph | step ms measured / planned | error | "
            "peak GiB measured / planned | error | source |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        m = r["measured"]
        p = r["planned"]
        step = (f"{1e3 * m['step_s']:.1f} / {1e3 * p['planned_step_s']:.1f}" if m.get("step_s") else "-")
        step_err = f"{100 * p['step_error']:+.1f}%" if "step_error" in p else "-"
        if m.get("cuda_graph"):
            mem = f"reserved {m['reserved_gib']:.1f} / {p['planned_reserved_gib']:.1f}"
            mem_err = f"{100 * p['reserved_error']:+.1f}%" if "reserved_error" in p else "-"
        else:
            mem = f"{m['peak_gib']:.2f} / {p['planned_peak_gib']:.2f}" if m.get("peak_gib") else "-"
            mem_err = f"{100 * p['peak_error']:+.1f}%" if "peak_error" in p else "-"
            if "working_error" in p:
                mem_err += f" (working {100 * p['working_error']:+.1f}%)"
            if "forward_saved_error" in p:
                mem_err += (f" (forward keeps {m['forward_saved_gib']:.2f} / {p['planned_forward_saved_gib']:.2f}, "
                            f"{100 * p['forward_saved_error']:+.1f}%)")
        fitted = f" fitted: {', '.join(m['fitted'])}" if m.get("fitted") else ""
        note = f" {m['note']}" if m.get("note") else ""
        lines.append(f"| {m['model']} ({m['layers']}) | {m['world']}x {m['gpu']} | {m['seq_len']} | {m['recompute']} | "
                     f"{m['lora_rank'] or '-'} | {'on' if m['cuda_graph'] else 'off'} | {step} | {step_err} | {mem} | "
                     f"{mem_err} | {m['source']}{fitted}{note} |")
    return "\n".join(lines)


def compare(measurements: list[Measured]) -> list[dict]:
    from dataclasses import asdict

    return [{"measured": asdict(m), "planned": predict(m)} for m in measurements]


# ---- measuring on a GPU --------------------------------------------------------------------------------------

FAMILIES = [  # (shipped config, layers: every kind of layer the family has)
    ("qwen3_30b_a3b", 4),
    ("gpt_oss_20b", 4),  # 2 sliding-window + 2 full-attention layers
    ("moonlight_16b_a3b", 4),  # 1 dense + 3 MoE layers (DeepSeek-V3's architecture)
    ("nemotron_3_nano_30b_a3b", 6),  # M E M E M *: Mamba-2, MoE and attention blocks
]
SETTINGS = [  # (seq_len, recompute), most informative first (the budget cuts the tail)
    (4096, "none"), (16384, "none"), (16384, "full"), (65536, "full"), (16384, "selective"), (65536, "none"),
]


@contextlib.contextmanager
def forward_saved_bytes(bench, device):
    """Each training forward's (loss included) growth of the allocated memory while the block runs: what
    it keeps for the backward (the CUDA allocator's host-side counter: no synchronisation)."""
    import torch

    growth: list[int] = []
    loss = bench.loss

    def measured_loss(input_ids):
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        out = loss(input_ids)
        if device.type == "cuda" and torch.is_grad_enabled():
            growth.append(torch.cuda.memory_allocated(device) - before)
        return out

    bench.loss = measured_loss
    try:
        yield growth
    finally:
        del bench.loss  # the class's method again


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    from moetune.bench.env import gpu_name, setup
    from moetune.bench.measure import matmul_peak_tflops
    from moetune.bench.models import build_side, load_config
    from moetune.bench.run import Row, run_rows
    from moetune.layers.activation_checkpointing import enable_activation_checkpointing

    env = setup(args.device)
    gpu = "h200" if "H200" in gpu_name(env.device) else "h100"  # a CPU smoke run is compared with the H100's
    peak = matmul_peak_tflops(env.device)
    print(json.dumps({"gpu": gpu_name(env.device), "calibration": gpu, "matmul_peak_tflops": peak}), flush=True)
    families = [(name, int(layers)) for name, layers in (m.split(":") for m in args.models)] if args.models else FAMILIES
    settings = [(int(seq), mode) for seq, mode in (s.split(":") for s in args.settings)] if args.settings else SETTINGS
    start, results = time.monotonic(), []
    out = Path(args.out) if args.out else None
    for family, layers in families:
        if time.monotonic() - start > args.budget:
            break
        _, config = load_config(family, layers=layers)
        bench = build_side("moetune", config, device=env.device, dtype=torch.bfloat16, seed=0)
        for seq_len, recompute in settings:
            if time.monotonic() - start > args.budget:
                print(json.dumps({"skipped": [family, seq_len, recompute], "reason": "time budget"}), flush=True)
                continue
            if recompute == "selective":  # the benchmark's rows switch full checkpointing only
                enable_activation_checkpointing(bench.model, "selective")
            row = Row("real", 1, seq_len, recompute == "full")
            with forward_saved_bytes(bench, env.device) as saved:
                [result] = run_rows(bench, [row], env=env, flops_per_token={seq_len: 1.0}, peak_tflops=None, warmup=2,
                                    steps=3, seed=0, lr=1e-5, moetune_optimizer="moetune")
            if recompute == "selective":
                (getattr(bench.model, "activation_checkpointing_disable", None) or bench.model.gradient_checkpointing_disable)()
            if result.error:
                print(json.dumps({"model": family, "seq_len": seq_len, "recompute": recompute, "error": result.error}),
                      flush=True)
                continue
            measured = Measured(model=family, layers=layers, gpu=gpu, seq_len=seq_len, recompute=recompute,
                                step_s=result.step_s, peak_gib=result.peak_gib, reserved_gib=result.reserved_gib,
                                state_gib=result.state_gib, forward_saved_gib=max(saved, default=0) / 2**30 or None,
                                source=f"measured {time.strftime('%Y-%m-%d')}")
            [entry] = compare([measured])
            results.append(entry)
            line = json.dumps(entry)
            print(line, flush=True)
            if out is not None:
                with open(out / "plan_validation.jsonl", "a") as file:
                    file.write(line + "\n")
        del bench
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recorded", action="store_true", help="compare with benchmarks/results/ (no GPU needed)")
    parser.add_argument("--out", default=None, help="folder for plan_validation.jsonl (GPU mode)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which no new setting starts")
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON instead of a table")
    parser.add_argument("--models", nargs="*", default=None, metavar="CONFIG:LAYERS",
                        help="families to measure (default: the four, at the layers listed in FAMILIES)")
    parser.add_argument("--settings", nargs="*", default=None, metavar="SEQ:RECOMPUTE",
                        help="settings to measure (default: SETTINGS)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only smoke-tests this script")
    args = parser.parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = compare(recorded_measurements()) if args.recorded else measure(args)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
