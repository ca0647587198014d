"""The fine-tuning job's schema: typed dataclasses, one docstring per field.

YAML files and dotted CLI overrides (``--optim.lr 1e-5``) only set these fields; see
``config_loading.py`` for how, and ``validate`` below for the cross-field checks.
A relative path in a YAML file is relative to the directory where the command runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moetune.lora import LoraSettings
from moetune.fp8.settings import DEFAULT_WEIGHT_GRAD, FP8_BACKENDS, FP8_RECIPES, FP8_WEIGHT_GRADS
from moetune.models.options import check_experts_backend
from moetune.options import DENSE_PARALLEL, EP_DISPATCH, REPLICATE_TRANSPORTS

DEFAULT_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "default"
"""The shipped default job's files: tiny Qwen3-MoE config, tokenizer, arithmetic dataset."""

PRECISIONS = ("auto", "fp32", "bf16_autocast", "bf16")
PARALLELISMS = ("fsdp", "ddp")
PACKING_STRATEGIES = ("best_fit", "in_order")
ON_BAD_ROW = ("skip", "fail")
TRUE_SPELLINGS = frozenset({"true", "yes", "on", "1"})
FALSE_SPELLINGS = frozenset({"false", "no", "off", "0"})
"""How a boolean may be written in YAML strings and CLI overrides (lower case)."""
CUDA_GRAPH_SETTINGS = ("true", "false", "auto")
_CUDA_GRAPH_SPELLINGS = {**dict.fromkeys(TRUE_SPELLINGS, "true"), **dict.fromkeys(FALSE_SPELLINGS, "false"), "auto": "auto"}


@dataclass
class ModelConfig:
    config_path: str = str(DEFAULT_ASSETS / "model")
    """Directory (or config.json) of a model config; the model is built from it with random
    weights. Used when ``pretrained_path`` is empty."""
    pretrained_path: str = ""
    """Directory of a Hugging Face checkpoint to fine-tune (weights are loaded from it). Takes
    precedence over ``config_path``. Must be local: nothing is downloaded."""
    tokenizer_path: str = str(DEFAULT_ASSETS / "tokenizer")
    """Directory of a Transformers tokenizer with a chat template. Empty: use ``pretrained_path``."""
    attn_implementation: str = ""
    """Transformers attention backend ("sdpa", "eager", "flex_attention", "flash_attention_2");
    empty keeps the model's default. Packed batches need one that honours per-document
    position_ids: all of these do (see data README)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30% slower)."""
    activation_checkpointing_mode: str = "full"
    """With activation_checkpointing: "full" (keep each layer's input, recompute the layer) or
    "selective" (keep GEMM and attention outputs, recompute norms, RoPE, SwiGLU, permutation)."""
    router_aux_loss_coef: float | None = None
    """Weight of the MoE load-balancing loss; None keeps the model config's value, 0 disables it."""
    experts_backend: str = "auto"
    """MoE models (moetune's, and Transformers' that take an experts implementation): the experts'
    GEMM kernels, "auto" (torch's grouped GEMM on CUDA bf16), "grouped_mm", "triton", "quack"
    (quack's CuTe-DSL grouped GEMMs: ~3% faster steps on an H200; needs the quack-kernels package
    and a CUDA sm90+ GPU) or "loop" (moetune.options)."""
    fp8: str = ""
    """FP8 (e4m3) training of the decoder's linear layers and experts (moetune's architectures):
    "rowwise" (a scale per token / per channel) or "blockwise" (DeepSeek-V3's 1 x 128 activation and
    128 x 128 weight blocks); empty: none. bf16 weights, AdamW and checkpoints as without it; the
    router, norms, LM head and loss keep their precision. Needs a GPU with FP8 tensor cores (sm89+)
    unless fp8_backend is "reference" (docs/fp8.md)."""
    fp8_backend: str = "auto"
    """With fp8: "auto" (torch's cuBLAS / CUTLASS FP8 GEMMs where torch has them, moetune's Triton
    GEMMs elsewhere), "triton" (moetune's Triton GEMMs everywhere) or "reference" (plain PyTorch on
    any device, CPU included: the numerics, slowly)."""
    fp8_weight_grad: str = DEFAULT_WEIGHT_GRAD
    """With fp8: the weight gradients' GEMM in "bf16" (the default: from the operands as the forward
    received them; faster at few tokens per expert, exact gradients, the loss of bf16 training) or
    "fp8" (quantised along the tokens, as DeepSeek-V3 trained)."""


@dataclass
class DataConfig:
    train_path: str = str(DEFAULT_ASSETS / "data" / "train.jsonl")
    """Training data: a .jsonl/.json/.parquet file, a directory saved by ``datasets``
    (``save_to_disk``), or a ``datasets`` name already in the local cache."""
    test_path: str = str(DEFAULT_ASSETS / "data" / "test.jsonl")
    """Held-out rows for exact-match accuracy (greedy generation of the last assistant turn).
    Empty: no accuracy evaluation."""
    split: str = "train"
    """Split to read when ``train_path`` is a ``datasets`` dataset."""
    messages_column: str = "messages"
    """Column with chat messages (a list of {"role", "content"}). Used when present."""
    prompt_column: str = "prompt"
    """Column with the prompt, used (with ``answer_column``) when there is no messages column."""
    answer_column: str = "answer"
    """Column with the answer to train on, paired with ``prompt_column``."""
    max_length: int = 256
    """Tokens per packed row (or per sample without packing); longer samples are truncated
    (and counted)."""
    packing: bool = True
    """Pack several samples into each row; positions and attention restart at each sample (moetune's
    Nemotron-H restarts its Mamba-2 state too). Refused for Transformers' models with recurrent
    layers (Jamba, Bamba, ...), whose state would cross samples."""
    pad_to_multiple_of: int = 0
    """Without packing, pad each micro-batch to the next multiple of this many tokens instead of to
    its longest sample (0: to the longest; Transformers' collators call it the same). Bounds the
    number of distinct step shapes at max_length / multiple: each new shape is a recompile under
    torch.compile (``experts_backend="quack"`` tunes per power-of-two bucket of routed rows, not per
    shape). Packed rows always have ``max_length`` tokens."""
    packing_strategy: str = "best_fit"
    """How samples fill the packed rows: "best_fit" (best-fit decreasing over each epoch's shuffled
    samples, then the rows shuffled: almost no padding) or "in_order" (next-fit in the shuffled
    order: keeps the order, pads a row whenever the next sample does not fit)."""
    val_fraction: float = 0.02
    """Fraction of the training rows held out for the validation loss (0 disables it)."""
    on_bad_row: str = "skip"
    """What to do with a malformed row: "skip" (and count it) or "fail"."""
    num_eval_samples: int = 200
    """Rows of ``test_path`` used for the exact-match accuracy (0: all)."""
    max_new_tokens: int = 8
    """Generation length limit for the exact-match evaluation."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate (reached after warm-up, then cosine decay). The default suits the embedded
    default job (a tiny model from scratch: 96-99% held-out exact match at seeds 1234, 1 and 7 on CPU,
    2026-12-07); pretrained models want far less (1e-5, the examples)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 50
    """Linear warm-up length in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping; the norm is still logged)."""


@dataclass
class TrainingConfig:
    steps: int = 800
    """Number of optimizer steps."""
    micro_batch_size: int = 8
    """Rows per forward pass on each device."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    precision: str = "auto"
    """"fp32", "bf16_autocast" (fp32 weights, bf16 compute), "bf16" (bf16 weights and optimizer
    states), or "auto": bf16_autocast on GPU, fp32 on CPU."""
    device: str = "auto"
    """"cpu", "cuda", or "auto" (the local GPU when there is one)."""
    seed: int = 1234
    """Seed of weights init, data order and every random generator."""
    num_threads: int = 1
    """CPU threads for torch's intra-op parallelism (0: torch's default, one per core). 1 by
    default: the default job's small matrices gain little from more, and on a CPU shared with
    other work, threads that wait for each other can make a step ten times slower."""
    cuda_graph: str = "auto"
    """"true": replay each step from CUDA graphs (moetune.training.CUDAGraphTrainStep): on a GPU the
    host no longer launches every kernel of the step, which an MoE step otherwise waits for. "auto"
    (the default): graphs for LoRA fine-tuning in one CUDA process with packed rows on moetune's
    architectures, where the eager step waits for the host most (1.86x the eager recipe's tokens/s
    on one H200, Qwen3 shapes, 8 layers; full fine-tuning gains 1.04x there and stays eager);
    "false": never. Needs packed rows (data.packing), an architecture whose layers take the
    documents' offsets (moetune's four: Qwen3-MoE, DeepSeek-V3, GPT-OSS, Nemotron-H), and with several
    processes expert parallelism with ep_dispatch "allgather" and dense_parallel "replicate". The
    first two steps run eagerly; off CUDA every step does. Measured with training.precision "bf16";
    "bf16_autocast" trains as the eager step on an H200 (GPU test)."""
    val_every: int = 250
    """Validation loss every this many steps (0: only at the end)."""
    plan_check: bool = True
    """Print the job's plan (``moetune plan``: memory per GPU by part, step time) before anything is
    loaded, and on GPUs refuse a job whose planned memory exceeds the GPU's (false: print only).
    Not on CPU, where there is no GPU memory to check (moetune/recipe/planning.py)."""
    output_dir: str = "outputs/default"
    """Where checkpoints, metrics, plots and the final Hugging Face export go. A new run refuses one
    that holds checkpoints (resume them, or pick another folder); an earlier run's metrics.jsonl is
    kept as metrics.<time>.jsonl."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a resumable checkpoint every this many steps (0: only on Ctrl-C)."""
    keep_last: int = 2
    """Number of periodic checkpoints kept; older ones (of the same run) are deleted."""
    resume: str = ""
    """"auto" (the latest checkpoint in output_dir, if any), a checkpoint directory, or empty. A run
    that resumes nothing needs an output_dir without checkpoints; a resume needs the same data and
    batching settings as the checkpoint, and an output_dir holding no checkpoint newer than it (none
    at all when it comes from another folder): two histories are never mixed in one folder."""
    export_final: bool = True
    """Write the final model (and tokenizer) in the Hugging Face layout to output_dir/final."""


@dataclass
class MetricsConfig:
    log_every: int = 10
    """Write a metrics line (and refresh the progress bar) every this many steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0 only)."""
    peak_tflops: float = 989.0
    """Peak bf16 dense TFLOP/s of one GPU, for MFU (H100/H200 datasheet). Not used on CPU."""
    tensorboard: bool = False
    """Also log to TensorBoard (output_dir/tensorboard) when the package is installed."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project when ``wandb`` is installed (empty: off)."""
    plots: bool = True
    """Write PNG plots of the loss curves and expert load per layer at the end."""
    profile_start: int = 0
    """Profile the training loop with torch.profiler from this step (1-based; 0: off), for
    ``profile_steps`` steps; traces and kernel tables go to output_dir/profile (moetune/recipe/profiling.py)."""
    profile_steps: int = 3
    """How many steps ``profile_start`` profiles."""


@dataclass
class LoraConfig(LoraSettings):
    """moetune.lora's settings (rank, alpha, dropout, target_modules, target_experts,
    adapter_dtype: documented there) plus the recipe's switches."""

    enabled: bool = False
    """Train LoRA adapters only; the base weights are frozen."""
    export_merged: bool = True
    """At the end also write a merged full checkpoint (adapters folded into the weights) to
    output_dir/final; the PEFT adapter always goes to output_dir/adapter."""


@dataclass
class DistributedConfig:
    parallelism: str = "fsdp"
    """Data parallelism when launched with several processes: "fsdp" (FSDP2) or "ddp"."""
    ep_size: int = 1
    """Expert parallelism (moetune's MoE architectures, under torchrun): experts split over this many
    ranks, everything else FSDP2-sharded over all ranks, on one device mesh (moetune.distributed).
    Must divide the number of processes and the number of experts; 1 = no expert parallelism."""
    ep_overlap_chunks: int = 1
    """With ep_size > 1: split each MoE layer's tokens into this many chunks so that on GPU the
    all-to-alls of one chunk overlap the experts' compute of another (same results; when it pays:
    moetune/distributed/README.md); 1 = no overlap."""
    ep_dispatch: str = "alltoall"
    """With ep_size > 1: "alltoall" (each routed copy of a token goes to its expert's rank) or
    "allgather" (every rank gets the group's tokens; fewer bytes when ep_size <= top-k); see
    moetune/distributed/README.md."""
    dense_parallel: str = "fsdp"
    """With ep_size > 1, the non-expert parameters: "fsdp" (sharded) or "replicate" (whole on every
    rank, gradients all-reduced; with ep_size < processes the experts are replicated over the
    ranks that hold the same experts)."""
    replicate_transport: str = "nccl"
    """With dense_parallel "replicate": "nccl" all-reduces, or "copy_engine" (2 GPU processes: a
    copy-engine push through symmetric memory per gradient; moetune/distributed/README.md)."""
    replicate_max_ctas: int = 16
    """With dense_parallel "replicate" on NCCL: the most CTAs of the gradient all-reduces'
    communicator (few, so they leave bandwidth to the experts' collectives); 0: NCCL's own choice."""
    global_aux_loss: bool = False
    """With moetune's sharding (ep_size > 1, or FSDP2 of an architecture moetune implements): the MoE
    load-balancing loss over all processes' tokens, as one process on the whole batch, instead of
    each process's own (Transformers under DDP)."""
    vocab_parallel: bool = False
    """With dense_parallel "replicate": split the input embedding and the LM head by vocabulary rows
    over all processes instead of replicating them (less memory and optimizer work per process; no
    all-reduce of the LM head's gradient; moetune/distributed/README.md)."""
    reduce_dtype: str = "float32"
    """Gradient reduce-scatter dtype with ep_size > 1 ("float32" exact sums, or "bfloat16")."""
    backend: str = ""
    """torch.distributed backend; empty: nccl on GPU, gloo on CPU."""
    timeout_minutes: float = 30.0
    """How long a collective or barrier waits for the other processes before the job fails (the
    process groups' timeout; torch's own defaults: 10 min on NCCL, 30 on gloo). The longest waits
    are the other ranks' while rank 0 alone writes the final export or a checkpoint's last files,
    which for a large model on a network filesystem take minutes; a lost node is reported after it."""
    host_gloo_group: bool = True
    """Sum each step's host numbers (token counts, the stop flag, the loss) over a gloo group of the
    ranks, so the host never waits for the GPU's queue for them; false: over the default group
    (NCCL on GPUs), e.g. on a cluster where gloo cannot reach the other nodes (or set
    GLOO_SOCKET_IFNAME to the interface it should use)."""


@dataclass
class JobConfig:
    """A complete fine-tuning job. Defaults describe the embedded default job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """What model and tokenizer to fine-tune."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where the data comes from and how it is turned into batches."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Steps, batch sizes, precision, device, seed, output directory."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic resumable checkpoints, resume, final export."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Logging, progress bar, plots."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (attention and experts) instead of full fine-tuning."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process data parallelism (under torchrun)."""


def validate(config: JobConfig) -> JobConfig:
    """Cross-field and range checks; raises ValueError naming the field. Returns ``config``."""

    def check(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ValueError(f"config field {name}: {message}")

    check(config.training.precision in PRECISIONS, "training.precision",
          f"{config.training.precision!r} is not one of {PRECISIONS}")
    check(config.training.device in ("auto", "cpu", "cuda"), "training.device",
          f"{config.training.device!r} is not one of ('auto', 'cpu', 'cuda')")
    check(config.distributed.parallelism in PARALLELISMS, "distributed.parallelism",
          f"{config.distributed.parallelism!r} is not one of {PARALLELISMS}")
    check(config.model.activation_checkpointing_mode in ("full", "selective"), "model.activation_checkpointing_mode",
          f"{config.model.activation_checkpointing_mode!r} is not one of ('full', 'selective')")
    try:  # the same check as from_pretrained's, before any work
        check_experts_backend(config.model.experts_backend)
    except (ValueError, RuntimeError) as err:
        check(False, "model.experts_backend", str(err))
    check(config.model.fp8 in ("", *FP8_RECIPES), "model.fp8", f"{config.model.fp8!r} is not one of {('', *FP8_RECIPES)}")
    check(config.model.fp8_backend in FP8_BACKENDS, "model.fp8_backend",
          f"{config.model.fp8_backend!r} is not one of {FP8_BACKENDS}")
    check(config.model.fp8_backend == "auto" or bool(config.model.fp8), "model.fp8_backend",
          "picks the FP8 kernels: set model.fp8 ('rowwise' or 'blockwise') too")
    check(config.model.fp8_weight_grad in FP8_WEIGHT_GRADS, "model.fp8_weight_grad",
          f"{config.model.fp8_weight_grad!r} is not one of {FP8_WEIGHT_GRADS}")
    check(config.model.fp8_weight_grad == DEFAULT_WEIGHT_GRAD or bool(config.model.fp8), "model.fp8_weight_grad",
          "picks the FP8 weight gradients' GEMM: set model.fp8 ('rowwise' or 'blockwise') too")
    check(config.distributed.ep_size >= 1, "distributed.ep_size", f"must be >= 1, got {config.distributed.ep_size}")
    check(config.distributed.ep_size == 1 or config.distributed.parallelism == "fsdp", "distributed.ep_size",
          "expert parallelism shards the rest with FSDP2: set distributed.parallelism to 'fsdp'")
    check(config.distributed.ep_dispatch in EP_DISPATCH, "distributed.ep_dispatch",
          f"{config.distributed.ep_dispatch!r} is not one of {EP_DISPATCH}")
    check(config.distributed.dense_parallel in DENSE_PARALLEL, "distributed.dense_parallel",
          f"{config.distributed.dense_parallel!r} is not one of {DENSE_PARALLEL}")
    check(config.distributed.replicate_transport in REPLICATE_TRANSPORTS, "distributed.replicate_transport",
          f"{config.distributed.replicate_transport!r} is not one of {REPLICATE_TRANSPORTS}")
    check(not config.distributed.vocab_parallel or config.distributed.dense_parallel == "replicate",
          "distributed.vocab_parallel", "splits the embedding and LM head of dense_parallel 'replicate' models; "
          "with 'fsdp' FSDP2 shards them already")
    check(config.distributed.ep_dispatch == "alltoall" or config.distributed.ep_overlap_chunks == 1,
          "distributed.ep_overlap_chunks", "chunked overlap refines the all-to-all dispatcher; with "
          "distributed.ep_dispatch 'allgather' leave it at 1")
    check(config.distributed.reduce_dtype in ("float32", "bfloat16"), "distributed.reduce_dtype",
          f"{config.distributed.reduce_dtype!r} is not one of ('float32', 'bfloat16')")
    check(str(config.training.cuda_graph).lower() in _CUDA_GRAPH_SPELLINGS, "training.cuda_graph",
          f"{config.training.cuda_graph!r} is not one of {CUDA_GRAPH_SETTINGS}")
    config.training.cuda_graph = _CUDA_GRAPH_SPELLINGS[str(config.training.cuda_graph).lower()]
    graphs = config.training.cuda_graph == "true"
    check(not graphs or config.data.packing, "training.cuda_graph",
          "needs data.packing (every captured step takes one fixed batch shape)")
    check(not graphs or config.distributed.ep_overlap_chunks == 1, "training.cuda_graph",
          "the chunked all-to-all dispatcher cannot be captured; leave distributed.ep_overlap_chunks at 1")
    check(config.data.packing_strategy in PACKING_STRATEGIES, "data.packing_strategy",
          f"{config.data.packing_strategy!r} is not one of {PACKING_STRATEGIES}")
    check(config.data.on_bad_row in ON_BAD_ROW, "data.on_bad_row",
          f"{config.data.on_bad_row!r} is not one of {ON_BAD_ROW}")
    check(config.data.pad_to_multiple_of >= 0, "data.pad_to_multiple_of",
          f"must be >= 0 (0: pad to the longest sample), got {config.data.pad_to_multiple_of}")
    for name, value in [
        ("training.steps", config.training.steps),
        ("training.micro_batch_size", config.training.micro_batch_size),
        ("training.grad_accum_steps", config.training.grad_accum_steps),
        ("data.max_length", config.data.max_length),
        ("data.max_new_tokens", config.data.max_new_tokens),
        ("checkpoint.keep_last", config.checkpoint.keep_last),
        ("metrics.log_every", config.metrics.log_every),
        ("metrics.profile_steps", config.metrics.profile_steps),
        ("distributed.ep_overlap_chunks", config.distributed.ep_overlap_chunks),
    ]:
        check(value >= 1, name, f"must be >= 1, got {value}")
    for name, value in [
        ("distributed.replicate_max_ctas", config.distributed.replicate_max_ctas),
        ("optim.warmup_steps", config.optim.warmup_steps),
        ("optim.weight_decay", config.optim.weight_decay),
        ("optim.grad_clip", config.optim.grad_clip),
        ("checkpoint.every", config.checkpoint.every),
        ("training.val_every", config.training.val_every),
        ("metrics.profile_start", config.metrics.profile_start),
        ("training.num_threads", config.training.num_threads),
        ("data.num_eval_samples", config.data.num_eval_samples),
    ]:
        check(value >= 0, name, f"must be >= 0, got {value}")
    check(config.optim.lr > 0, "optim.lr", f"must be > 0, got {config.optim.lr}")
    check(0.0 <= config.optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio",
          f"must be in [0, 1], got {config.optim.min_lr_ratio}")
    check(0.0 <= config.data.val_fraction < 1.0, "data.val_fraction",
          f"must be in [0, 1), got {config.data.val_fraction}")
    check(all(0.0 <= b < 1.0 for b in config.optim.betas), "optim.betas",
          f"each beta must be in [0, 1), got {config.optim.betas}")
    check(bool(config.model.pretrained_path or config.model.config_path), "model.config_path",
          "set model.pretrained_path or model.config_path")
    check(bool(config.model.tokenizer_path or config.model.pretrained_path), "model.tokenizer_path",
          "set model.tokenizer_path (or model.pretrained_path, whose tokenizer is then used)")
    check(bool(config.data.train_path), "data.train_path", "must not be empty")
    check(config.metrics.peak_tflops > 0, "metrics.peak_tflops", "must be > 0")
    check(config.distributed.timeout_minutes > 0, "distributed.timeout_minutes",
          f"must be > 0, got {config.distributed.timeout_minutes}")
    return config
