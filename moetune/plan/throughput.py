"""Step time of one GPU, from the model's work and the calibrated rates of the kernels doing it.

Per micro-batch (T = micro_batch x seq_len tokens on this rank), forward + backward:
- dense GEMMs (projections, dense and shared MLPs, latent projections, LM head):
  3 x forward FLOPs at ``matmul_tflops x dense_gemm_efficiency`` (LoRA: 2x, the frozen weights get
  no weight gradient);
- routed experts: 3 x (2x for LoRA) top-k x 2 x one expert's weights per token on the busiest rank
  (``ep_routing_imbalance`` x the mean under expert parallelism) at the grouped GEMM rate for the
  rows each expert gets (``grouped_gemm_tflops`` at 256 rows, scaled by m / (m + m0));
- attention: the brief's causal FLOPs at the measured rate of the kernel the family runs (cuDNN
  GQA, GPT-OSS's sink attention, DeepSeek-V3's latent attention; sliding windows at a fraction);
- Mamba-2 scans at the measured time per token, less what frozen weights (LoRA) skip in the scan's
  backward (the convolution's and the scan's own weight gradients); routers in fp32 at the measured
  SIMT rate;
- memory-bound kernels: ``membound_traffic`` bytes per byte of each layer's kept activations at
  the HBM bandwidth (recomputed layers pay their forward's share again);
- recomputation: checkpointed layers run their forward twice;
- communication on the critical path: the expert-parallel dispatch and combine (all-to-all or
  all-gather + reduce-scatter, forward and backward) over NVLink within a node and the NICs across
  nodes; FSDP2's per-layer all-gathers and reduce-scatters and the replicated gradients'
  all-reduces overlap the compute, only what exceeds it counts;
- eager steps leave the GPU idle while the host launches kernels (``eager_idle_ms_per_layer``);
  CUDA-graph replays do not;
- FP8 (the default recipe, bf16 weight gradients): the forward and input-gradient passes of the
  decoder's GEMMs (experts and dense, not the LM head) at ``fp8_gemm_speedup`` (their activations'
  quantisation included), and each micro-batch quantises every FP8 weight in two layouts (forward and
  input gradient: 2 bytes read + 1 written each, again for a recomputed forward) at
  ``fp8_weight_quantize_tbps``: a fixed cost a micro-batch that more tokens amortise.
Per optimizer step: AdamW streams 14 bytes per bf16 parameter element (28 in fp32) at the
optimizer's bandwidth, plus one launch per tensor, plus the gradient-norm read when clipping.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.plan.activations import layer_activations
from moetune.plan.calibration import Calibration
from moetune.plan.inventory import Inventory, LayerShape
from moetune.plan.memory import layout_for, precision_bytes
from moetune.plan.setting import PlanRequest, Setting
from moetune.plan.sharding import Layout, rank_state

TERA = 1e12


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per optimizer step on the busiest rank."""

    dense_gemm: float
    experts: float
    attention: float
    other_compute: float
    """Mamba-2 scans, fp32 routers."""
    memory_bound: float
    communication: float
    """Exposed communication (the dispatcher's collectives; what FSDP2 / all-reduces do not hide)."""
    host_idle: float
    optimizer: float
    tokens_per_step: int
    """Tokens per step on one GPU."""
    flops_per_token: float
    """The brief's convention (moetune.flops), for MFU."""

    @property
    def step(self) -> float:
        return (self.dense_gemm + self.experts + self.attention + self.other_compute + self.memory_bound
                + self.communication + self.host_idle + self.optimizer)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step

    def mfu(self, peak_tflops: float) -> float:
        return self.tokens_per_s * self.flops_per_token / (peak_tflops * TERA)


def step_time(inventory: Inventory, request: PlanRequest, setting: Setting, calibration: Calibration) -> TimeBreakdown:
    c = calibration
    layout = layout_for(request, setting)
    tokens = setting.micro_batch * request.seq_len
    lora = inventory.lora_rank > 0
    passes = 2.0 if lora else 3.0  # forward + input gradients (+ weight gradients)
    fp8 = _fp8_gemm_factor(c, passes) if request.fp8 else 1.0
    dense_rate = c["matmul_tflops"] * c["dense_gemm_efficiency"] * TERA
    imbalance = c["ep_routing_imbalance"] if setting.ep > 1 else 1.0
    recompute_forward = {"none": 0.0, "selective": 0.0, "full": 1.0}[setting.recompute]
    _, act_bytes = precision_bytes(request)

    dense = experts = attention = other = membound = comm = 0.0
    layer_seconds = []
    for layer in inventory.layers:
        forward_share = 1.0 / passes  # the part of the layer's compute that recomputation repeats
        layer_dense = passes * layer.dense_forward_flops * tokens / dense_rate * fp8
        layer_experts = _expert_seconds(layer, setting, c, tokens, passes, imbalance, routing=request.routing) * fp8
        layer_attention = _attention_seconds(layer, c, request.seq_len, tokens)
        layer_other = _mamba_seconds(layer, c, tokens, frozen=lora) + 3.0 * layer.router_forward_flops * tokens / _router_rate(inventory, c)
        acts = layer_activations(layer, act_bytes=act_bytes, ep=setting.ep, lora_rank=inventory.lora_rank,
                                 routed_rows=None if layer.moe is None else layer.moe.top_k * imbalance,
                                 seq_len=request.seq_len)
        layer_mem = c["membound_traffic"] * acts.held_in_backward * tokens / (c["hbm_tbps"] * TERA)
        # FP8's weight quantisation is memory-bound too; it counts its own recomputation.
        layer_quantize = _fp8_weight_quantize_seconds(layer, setting, c, recompute_forward) if request.fp8 else 0.0
        # Recomputation: full checkpointing repeats the layer's forward; selective repeats the cheap ops.
        repeat = recompute_forward * forward_share
        parts = (layer_dense * (1 + repeat), layer_experts * (1 + repeat), layer_attention * (1 + recompute_forward / 3.0),
                 layer_other * (1 + recompute_forward / 3.0),
                 layer_mem * (1 + (1 / 3.0 if setting.recompute != "none" else 0.0)) + layer_quantize,
                 _dispatch_seconds(layer, setting, layout, c, tokens, act_bytes, repeats=1 + recompute_forward / 2))
        dense, experts, attention, other, membound, comm = (
            total + part for total, part in zip((dense, experts, attention, other, membound, comm), parts))
        layer_seconds.append(sum(parts))
    # LoRA's low-rank paths read each adapted weight's input rows and add into its output rows, forward and backward.
    membound += 3 * _lora_row_elements(inventory) * act_bytes * tokens / (c["hbm_tbps"] * TERA)
    head = passes * 2.0 * inventory.hidden * inventory.vocab * tokens / dense_rate
    head_mem = 4 * inventory.vocab * tokens * act_bytes / (c["hbm_tbps"] * TERA)  # logits written, read by the loss, twice
    dense += head
    membound += head_mem
    compute = dense + experts + attention + other + membound
    comm += _sharding_seconds(inventory, request, setting, layout, c, compute)
    idle = 0.0 if setting.cuda_graph else _host_idle(layer_seconds, layout, setting, c)
    per_micro_batch = (compute, comm, idle)
    accum = setting.grad_accum
    optimizer = _optimizer_seconds(inventory, request, setting, layout, c)
    flops = inventory.flops.per_token(request.seq_len, frozen_weights=lora)
    return TimeBreakdown(
        dense_gemm=dense * accum, experts=experts * accum, attention=attention * accum, other_compute=other * accum,
        memory_bound=membound * accum, communication=per_micro_batch[1] * accum, host_idle=idle * accum,
        optimizer=optimizer, tokens_per_step=tokens * accum, flops_per_token=flops,
    )


def _fp8_gemm_factor(c: Calibration, passes: float) -> float:
    """FP8 GEMM time / bf16's over a layer's passes: forward and input gradient in FP8, the weight
    gradient (full fine-tuning's third pass) in bf16."""
    fp8_passes = 2.0
    return (fp8_passes / c["fp8_gemm_speedup"] + (passes - fp8_passes)) / passes


def _fp8_weight_quantize_seconds(layer: LayerShape, setting: Setting, c: Calibration, recompute_forward: float) -> float:
    """One micro-batch's quantisation of the layer's FP8 weights on this rank: 3 bytes an element (2 read,
    1 written) for each of the two layouts, and the forward's again when the layer is recomputed."""
    elements = layer.dense_forward_flops / 2.0
    if layer.moe is not None:
        elements += layer.expert_forward_flops / (2.0 * layer.moe.top_k) * layer.moe.num_experts / setting.ep
    return 3.0 * (2.0 + recompute_forward) * elements / (c["fp8_weight_quantize_tbps"] * TERA)


def _host_idle(layer_seconds: list[float], layout: Layout, setting: Setting, c: Calibration) -> float:
    """GPU time lost to the host in an eager step. One GPU: the launch gaps of a GPU-bound step. Several:
    the host synchronises once per MoE layer (the dispatcher's counts) and FSDP2 / DTensor add host
    work per layer, so a layer takes at least its host time."""
    if layout.world == 1:
        return c["eager_idle_ms_per_layer"] * 1e-3 * len(layer_seconds)
    key = "fsdp_alltoall" if setting.dense_parallel == "fsdp" else "replicate_allgather"
    host = c["eager_host_ms_per_layer"][key] * 1e-3
    return sum(max(c["eager_idle_ms_per_layer"] * 1e-3, host - seconds) for seconds in layer_seconds)


def _lora_row_elements(inventory: Inventory) -> float:
    """Per token: input plus output width of every adapted weight (routed experts' x top-k)."""
    total = 0.0
    for param in inventory.params:
        if "lora_A" in param.name or "lora_B" in param.name:
            width = param.shape[-1] if "lora_A" in param.name else param.shape[-2]
            total += width * (inventory.top_k if param.expert else 1)
    return total


def _router_rate(inventory: Inventory, c: Calibration) -> float:
    fp32_router = any(p.dtype_bytes == 4 and p.shape[0] == inventory.num_experts and len(p.shape) == 2
                      for p in inventory.params if not p.expert)
    return (c["router_fp32_tflops"] if fp32_router else c["matmul_tflops"] * c["dense_gemm_efficiency"]) * TERA


def _expert_seconds(layer: LayerShape, setting: Setting, c: Calibration, tokens: int, passes: float,
                    imbalance: float, *, routing: str) -> float:
    if layer.moe is None:
        return 0.0
    rows = tokens * layer.moe.top_k * imbalance  # routed rows on the busiest rank
    local_experts = layer.moe.num_experts / setting.ep
    per_expert = rows / local_experts
    m0 = c["grouped_gemm_half_rate_rows"]
    rate_256 = c["grouped_gemm_tflops"][routing]
    rate = rate_256 * (per_expert / (per_expert + m0)) / (256 / (256 + m0))
    rate = min(rate, c["matmul_tflops"] * 0.9) * TERA
    flops = passes * layer.expert_forward_flops * tokens * imbalance
    return flops / rate


def _attention_seconds(layer: LayerShape, c: Calibration, seq_len: int, tokens: int) -> float:
    a = layer.attention
    if a is None:
        return 0.0
    rates = c["attention_tflops"]
    kind = "mla" if a.latent else ("sink" if a.qk_head_dim < 128 else "gqa")
    rate = rates[kind] * TERA
    keys = seq_len / 2
    if a.window and a.window < seq_len:
        keys = a.window - a.window * (a.window - 1) / (2 * seq_len)
        rate *= c["sliding_window_efficiency"]
    per_token = 2 * a.heads * (a.qk_head_dim + a.v_head_dim) * keys
    return 3.0 * per_token * tokens / rate


def _mamba_seconds(layer: LayerShape, c: Calibration, tokens: int, *, frozen: bool) -> float:
    """The mixer's scan, forward + backward; ``frozen`` (LoRA): without the weight gradients of the
    convolution, ``A_log``, ``D``, ``dt_bias`` and the gated norm, which the mixer probe times apart
    (its projections' weight gradients are dense GEMMs, priced with them)."""
    m = layer.mamba
    if m is None:
        return 0.0
    scale = (m.heads * m.head_dim * m.state) / (64 * 64 * 128)  # relative to Nemotron 3 Nano's mixer
    per_token = c["mamba_scan_us_per_token"] - (c["mamba_weight_grad_us_per_token"] if frozen else 0.0)
    return per_token * 1e-6 * scale * tokens


def _link(layout: Layout, ranks: int, c: Calibration, *, consecutive: bool) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of a collective over ``ranks`` ranks: NVLink when they share
    a node (consecutive ranks within one node), the NICs otherwise."""
    within = ranks <= layout.gpus_per_node and (consecutive or layout.world <= layout.gpus_per_node)
    if within:
        return c["nvlink_busbw_gbps"] * 1e9, c["nvlink_latency_us"] * 1e-6
    return c["inter_node_busbw_gbps"] * 1e9, c["inter_node_latency_us"] * 1e-6


def _dispatch_seconds(layer: LayerShape, setting: Setting, layout: Layout, c: Calibration, tokens: int,
                      act_bytes: int, *, repeats: float) -> float:
    """The MoE layer's dispatcher collectives, forward and backward: they sit on the critical path."""
    if layer.moe is None or setting.ep == 1:
        return 0.0
    ep, width = setting.ep, layer.moe.expert_in
    imbalance = c["ep_routing_imbalance"]
    if setting.ep_dispatch == "allgather":
        gather = tokens * width * act_bytes * (ep - 1)  # received per rank
        partials = tokens * width * 4 * (ep - 1)  # fp32 partial sums reduce-scattered
        bandwidth, latency = _link(layout, ep, c, consecutive=True)
        one_way = (gather + partials) / bandwidth + 2 * latency
        return 2 * one_way * repeats
    rows_bytes = tokens * layer.moe.top_k * imbalance * width * act_bytes
    in_node = min(ep, layout.gpus_per_node)
    off_node_fraction = max(0, ep - in_node) / ep
    nvlink = c["nvlink_busbw_gbps"] * 1e9
    nic = c["inter_node_busbw_gbps"] * 1e9
    transfer = max(rows_bytes * (in_node - 1) / ep / nvlink, rows_bytes * off_node_fraction / nic)
    latency = (c["inter_node_latency_us"] if off_node_fraction else c["nvlink_latency_us"]) * 1e-6
    # dispatch + combine, each with its backward; the counts' exchange and host sync per layer
    return 4 * (transfer + latency) * repeats + 2 * latency


def _sharding_seconds(inventory: Inventory, request: PlanRequest, setting: Setting, layout: Layout,
                      c: Calibration, compute: float) -> float:
    """FSDP2's gathers and reduce-scatters, or the replicated gradients' all-reduce, beyond the compute
    they overlap."""
    if layout.world == 1:
        return 0.0
    state_bytes, _ = precision_bytes(request)
    links = tuple(c[name] for name in ("nvlink_busbw_gbps", "nvlink_latency_us", "inter_node_busbw_gbps",
                                       "inter_node_latency_us"))
    total = inventory.memoized(("sharding_seconds", layout, state_bytes, links),
                               lambda: _sharding_total(inventory, layout, c, state_bytes))
    # Overlapped with the compute; the first layer's gather and the last reduce-scatter are not.
    exposed_floor = total / max(1, len(inventory.layers))
    return max(exposed_floor, total - compute)


def _sharding_total(inventory: Inventory, layout: Layout, c: Calibration, state_bytes: int | None) -> float:
    total = 0.0
    for param in inventory.params:
        size = state_bytes or param.dtype_bytes
        if param.expert:
            ranks = layout.replicas
            if ranks == 1:
                continue
            numel = param.numel / layout.ep
            consecutive = False
        else:
            ranks, numel, consecutive = layout.world, param.numel, True
        bandwidth, _ = _link(layout, ranks, c, consecutive=consecutive)
        fraction = (ranks - 1) / ranks
        if layout.dense_parallel == "fsdp":
            gathers = 2 * numel * size  # forward and backward (parameters resharded after the forward)
            reduce = numel * 4 if param.trainable else 0.0  # fp32 reduce-scatter
            total += (gathers + reduce) * fraction / bandwidth
        elif param.trainable:
            total += 2 * numel * size * fraction / bandwidth  # ring all-reduce
    latency = c["inter_node_latency_us"] if layout.world > layout.gpus_per_node else c["nvlink_latency_us"]
    return total + 3 * len(inventory.layers) * latency * 1e-6


def _optimizer_seconds(inventory: Inventory, request: PlanRequest, setting: Setting, layout: Layout,
                       c: Calibration) -> float:
    state_bytes, _ = precision_bytes(request)
    state = rank_state(inventory, layout, 0, param_bytes=state_bytes, grad_bytes=state_bytes,
                       optimizer_bytes=state_bytes)
    # AdamW reads parameter, gradient and both moments and writes three of them: 7 elements.
    streamed = 3.5 * state.grads_local
    bandwidth = c["adamw_tbps"][request.optimizer] * TERA
    tensors = sum(1 for p in inventory.params if p.trainable)
    seconds = streamed / bandwidth + tensors * c["kernel_launch_us"] * 1e-6
    if request.clip_grad:
        seconds += state.grads_local / (c["hbm_tbps"] * TERA)
    return seconds
