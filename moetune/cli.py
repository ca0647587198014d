"""The ``moetune`` command.

    moetune finetune                                   # the embedded default job
    moetune finetune -c examples/qwen3_30b_a3b_sft.yaml --optim.lr 1e-5
    moetune finetune -c cfg.yaml --nproc-per-node 8     # re-executed through torchrun
    moetune finetune --help-config                     # every config field, its default and doc
    moetune finetune --help                            # the command's own options
    moetune finetune -c cfg.yaml --dry-run --nproc-per-node 8 --plan-gpu h100   # print the plan, run nothing
    moetune bench --layers 8 --routing both            # side by side with Transformers v5 (GPU)
    moetune plan deepseek_v3 --nodes 16 --gpu h100     # the settings, memory and step time, before a run
"""

from __future__ import annotations

import argparse
import os
import sys


def _finetune_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetune finetune",
        allow_abbrev=False,  # "--c..." must stay a config override, never an abbreviation
        description="Fine-tune a (MoE) causal LM. Any config field can be set as --section.field VALUE "
                    "(command line > YAML > defaults); see --help-config for the list.",
    )
    parser.add_argument("-c", "--config", help="YAML file with the job's config")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="start this many processes (>= 1) on this node through torchrun (torch.distributed.run)")
    parser.add_argument("--help-config", action="store_true", help="list every config field and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the job's plan (memory per GPU by part, step time; moetune plan) and exit without "
                             "loading anything: for --nproc-per-node processes on --plan-nodes nodes")
    parser.add_argument("--plan-gpu", default=None,
                        help="with --dry-run: the GPU type to plan for (h100, h200; default: this machine's GPU, or none)")
    parser.add_argument("--plan-nodes", type=int, default=1, help="with --dry-run: nodes of --nproc-per-node processes")
    return parser


def finetune_main(argv: list[str]) -> int:
    parser = _finetune_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.help_config:
        from moetune.recipe.config_loading import describe

        for key, default, doc in describe():
            print(f"--{key} (default {default})\n    {doc}")
        return 0
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node: must be >= 1 (processes to start on this node), got {args.nproc_per_node}")
    if args.dry_run:
        return dry_run(parser, args, overrides)
    if args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ:
        tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
        if tasks > 1:
            # Each srun task would start a job of its own (--standalone), all writing one output folder.
            parser.error(f"--nproc-per-node starts one node's job, but srun started this command {tasks} times: "
                         "launch torchrun yourself (srun ... python -m torch.distributed.run --nnodes N "
                         "--rdzv-backend c10d ...; examples/slurm_qwen3_30b_a3b.sbatch)")
        # Not a launcher of our own: torchrun handles rendezvous, env vars and failures.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", "-m", "moetune.cli", "finetune", *_without_nproc(argv)]
        os.execv(sys.executable, cmd)
    from moetune.recipe.checkpointing import CheckpointWriteError
    from moetune.recipe.config_loading import load_config
    from moetune.recipe.train import NonFiniteLossError, finetune

    try:
        config = load_config(yaml_path=args.config, overrides=overrides)
    except ValueError as err:
        parser.error(str(err))
    try:
        result = finetune(config)
    except (ValueError, NonFiniteLossError, CheckpointWriteError) as err:
        # A user's mistake (bad path, malformed data, wrong checkpoint), a diverged run or a full
        # disk: the message says what and where; a traceback would only hide it.
        print(f"moetune finetune: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    code = 130 if result.interrupted else 0  # 128 + SIGINT, the shell's convention
    if "LOCAL_RANK" in os.environ:
        # A torchrun worker whose job is done and whose files are written and closed: exit now.
        # Interpreter teardown after torch.distributed (gloo) sometimes aborts with "terminate called
        # without an active exception", which would turn a finished run into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def dry_run(parser: argparse.ArgumentParser, args: argparse.Namespace, overrides: list[str]) -> int:
    """``moetune finetune --dry-run``: the job's plan, for the processes and GPU it names; nothing runs."""
    import torch

    from moetune.recipe.config_loading import load_config
    from moetune.recipe.model_loading import load_model_config
    from moetune.recipe.planning import JobShape, dry_run_cuda_graph, plan_job

    try:
        config = load_config(yaml_path=args.config, overrides=overrides)
        model_config = load_model_config(config.model)
    except ValueError as err:
        parser.error(str(err))
    per_node = args.nproc_per_node or 1
    gpu, memory = args.plan_gpu, None
    if gpu is None and torch.cuda.is_available() and config.training.device != "cpu":
        props = torch.cuda.get_device_properties(0)
        gpu, memory = props.name, props.total_memory / 1024**3
    gpu = gpu or "cpu"
    world = per_node * args.plan_nodes
    shape = JobShape(world=world, gpus_per_node=per_node, gpu=gpu, gpu_memory_gib=memory,
                     cuda_graph=dry_run_cuda_graph(config, model_config, world=world, gpu=gpu))
    from moetune.plan import format_plan

    try:
        plan = plan_job(config, model_config, shape)
    except ValueError as err:
        print(f"moetune finetune: error: {err}", file=sys.stderr)
        return 2
    if plan is None:
        print(f"moetune finetune --dry-run: no plan for {model_config.model_type!r} (moetune plans the architectures it "
              "implements)")
        return 0
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` minus ``--nproc-per-node N`` / ``--nproc-per-node=N`` (the children must not re-exec)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def bench_main(argv: list[str]) -> int:
    """``moetune bench``: Transformers v5 and moetune side by side (moetune/bench)."""
    from moetune.bench.cli import main as run_bench  # imported on use: the recipe does not need it

    return run_bench(argv)


def plan_main(argv: list[str]) -> int:
    """``moetune plan``: size a run before it starts (moetune/plan)."""
    from moetune.plan.cli import main as run_plan

    return run_plan(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"finetune": finetune_main, "bench": bench_main, "plan": plan_main}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
