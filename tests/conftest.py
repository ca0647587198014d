"""Shared fixtures: tiny configs, Transformers reference models saved in both checkpoint layouts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

torch.set_num_threads(min(2, os.cpu_count() or 1))


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported as a module (the benchmarks folder is not a package): its
    arithmetic is tested here, since the GPU runs that feed it are scarce."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_qwen3_moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    settings = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return transformers.Qwen3MoeConfig(**settings)


def tiny_family_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny config of the parity tests of one of moetune's other families."""
    from tests.test_deepseek_v3_parity import tiny_deepseek_v3_config
    from tests.test_gpt_oss_parity import tiny_gpt_oss_config
    from tests.test_nemotron_h_parity import tiny_nemotron_h_config

    return {"deepseek_v3": tiny_deepseek_v3_config, "gpt_oss": tiny_gpt_oss_config, "nemotron_h": tiny_nemotron_h_config}[family](**overrides)


def family_reference(family: str, **overrides) -> transformers.PreTrainedModel:
    """Transformers' causal LM of one of moetune's families on its parity tests' tiny config (seeded
    fp32 weights, train mode)."""
    if family == "qwen3_moe":
        return seeded_reference(transformers.Qwen3MoeForCausalLM, tiny_qwen3_moe_config(**overrides))
    from tests import test_deepseek_v3_parity, test_gpt_oss_parity, test_nemotron_h_parity

    module = {"deepseek_v3": test_deepseek_v3_parity, "gpt_oss": test_gpt_oss_parity, "nemotron_h": test_nemotron_h_parity}
    return module[family].reference(**overrides)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def save_per_expert_checkpoint(model: torch.nn.Module, folder: Path, *, max_tensors_per_shard: int | None = None) -> Path:
    """Write ``model`` the way Hub checkpoints store MoE experts (one tensor per expert and
    projection), independently of moetune's writer; optionally sharded with an index."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, block in enumerate(tensor):
                gate, up = block.chunk(2, dim=0)
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                tensors[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, block in enumerate(tensor):
                tensors[f"{prefix}{e}.down_proj.weight"] = block.clone()
        else:
            tensors[name] = tensor.clone()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    names = sorted(tensors)
    if max_tensors_per_shard is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        chunks = [names[i : i + max_tensors_per_shard] for i in range(0, len(names), max_tensors_per_shard)]
        weight_map = {}
        for i, chunk in enumerate(chunks):
            file = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
            save_file({k: tensors[k] for k in chunk}, str(folder / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in chunk})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(folder)
    return folder


@pytest.fixture
def reference_qwen3_moe():
    """A Transformers Qwen3-MoE with random (seeded) weights, fp32, in train mode."""

    def build(**overrides):
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides))
        # Transformers initialises the router to zeros-then-normal; make routing decisive anyway.
        return model

    return build


def parity_batch(vocab: int, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, labels) of 2 x 12 tokens; ``padded`` left-pads row 1, as generate() does."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if padded:
        mask[1, :4] = 0
        labels[1, :4] = -100
    return ids, mask, labels


def check_bf16_training_parity(folder, vocab: int, experts_backend: str = "auto", device: str = "cuda") -> None:
    """moetune in bf16 on CUDA (or ``device``) against Transformers in fp32 holding the same weights:
    the loss within 1e-2 and each gradient within 1e-2, or no further than Transformers' own bf16
    model's. ``experts_backend="quack"`` needs quack-kernels (skipped where it is not installed)."""
    import moetune

    if experts_backend == "quack":
        pytest.importorskip("quack.gemm_interface", reason="quack-kernels is not installed")

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).train()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).train()
    ours = moetune.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map=device, experts_backend=experts_backend
    ).train()
    ids = parity_batch(vocab, padded=False)[0].to(device)
    losses = {}
    for name, model in (("ref", ref), ("hf", hf_bf16), ("ours", ours)):
        losses[name] = model(input_ids=ids, labels=ids).loss
        losses[name].backward()
    ref_params, hf_params = dict(ref.named_parameters()), dict(hf_bf16.named_parameters())
    assert rel_err(losses["ours"].float(), losses["ref"]) < 1e-2
    for name, param in ours.named_parameters():
        err = rel_err(param.grad.float(), ref_params[name].grad)
        assert err < max(1e-2, 2 * rel_err(hf_params[name].grad.float(), ref_params[name].grad)), name


def forbid_qwen3_mask_preparation(monkeypatch, why: str) -> None:
    """Make Transformers' Qwen3-MoE mask preparation (a host sync) fail with ``why`` for the test."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def no_mask_preparation(*args, **kwargs):
        raise AssertionError(why)

    monkeypatch.setattr(modeling_qwen3_moe, "create_causal_mask", no_mask_preparation)


def check_fused_loss_and_gradients(ours, ref, expected_loss, tol: float = 1e-5, **inputs) -> None:
    """Backward through Transformers' ``expected_loss``, then moetune's training forward on ``inputs``
    (fused LM-head loss: no logits) must give the same loss and every parameter the same gradient."""
    expected_loss.backward()
    fused = ours(**inputs)
    assert fused.logits is None and rel_err(fused.loss, expected_loss) < tol
    fused.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None, name
        assert rel_err(param.grad, ref_params[name].grad) < tol, name


def check_training_parity(ours, ref, *, padded: bool, tol: float = 1e-5) -> None:
    """moetune's model in train mode against Transformers' on ``parity_batch``: logits (plain
    forward, padded positions left out), loss and aux loss (both None or equal), then the fused
    training loss and every gradient. Unpadded batches pass no mask (moetune's plain causal path)."""
    ours.train()
    ref.train()
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=padded)
    inputs = {"input_ids": ids, "attention_mask": mask if padded else None, "labels": labels}
    # No KV cache in training (Transformers 5.25's Nemotron-H cache fails when layer 0 is an MoE).
    expected = ref(**inputs, use_cache=False)
    got = ours(**inputs, return_logits=True)
    keep = mask.bool()
    assert rel_err(got.logits[keep], expected.logits[keep]) < tol
    assert rel_err(got.loss, expected.loss) < tol
    expected_aux = getattr(expected, "aux_loss", None)
    assert (got.aux_loss is None) == (expected_aux is None)
    if expected_aux is not None:
        assert rel_err(got.aux_loss, expected_aux) < tol
    check_fused_loss_and_gradients(ours, ref, expected.loss, tol, **inputs)


def seeded_reference(model_cls, config, *, randomized_suffixes: tuple[str, ...] = ()) -> torch.nn.Module:
    """Transformers' model with seed-0 weights in fp32, train mode; parameters and buffers whose
    names end with one of ``randomized_suffixes`` (biases that initialise to zero) drawn N(0, 0.1)."""
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if randomized_suffixes and name.endswith(randomized_suffixes):
                tensor.normal_(0.0, 0.1)
    return model.train()


def check_generation_and_reload(ours, ref, tmp_path) -> None:
    """Greedy generation equals Transformers'; what moetune saves, plain Transformers loads back
    with the same logits."""
    ours.eval()
    ref.eval()
    ids = parity_batch(ref.config.vocab_size, padded=False)[0][:1, :5]
    settings = {"max_new_tokens": 6, "do_sample": False}
    assert torch.equal(ours.generate(ids, **settings), ref.generate(ids, **settings))
    ours.save_pretrained(tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").float().eval()
    assert rel_err(reloaded(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


def save_with_transformers(model: torch.nn.Module, tmp_path: Path) -> Path:
    """``model.save_pretrained`` into ``tmp_path / "ckpt"`` (Transformers writes its Hub layout)."""
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def quantize_fp8_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite ``folder``'s single-file checkpoint the way the Hub's DeepSeek-V3 / Qwen3 "-FP8" files
    are: every projection weight in FP8 e4m3 with 128 x 128 block scales (``<key>_scale_inv``), and
    ``quantization_config`` in config.json. Returns the values each quantized key dequantizes to."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    expected = {}
    for key in [k for k in tensors if k.endswith("proj.weight")]:
        weight = tensors[key].float()
        rows, cols = -(-weight.shape[0] // 128), -(-weight.shape[1] // 128)
        padded = torch.nn.functional.pad(weight, (0, cols * 128 - weight.shape[1], 0, rows * 128 - weight.shape[0]))
        scale = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        per_value = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: weight.shape[0], : weight.shape[1]]
        tensors[key] = (weight / per_value).to(torch.float8_e4m3fn)
        tensors[key + "_scale_inv"] = scale
        expected[key] = tensors[key].float() * per_value
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def check_packed_documents_parity(ours, ref, *, offsets: bool = True, forward_context=contextlib.nullcontext,
                                  tol: float = 1e-5) -> None:
    """Packed rows (position_ids restarting per document, no mask; with ``offsets`` also the
    documents' ``cu_seq_lens_q`` / ``max_length_q``, what the recipe passes): each document's logits
    and the gradients of a loss over them equal Transformers run on the documents one by one.
    ``forward_context()`` wraps moetune's forward only (e.g. forbidding mask preparation)."""
    ref.train()
    ours.train()
    torch.manual_seed(3)
    rows = [[9, 7], [16], [3, 5, 8]]  # documents per row, 16 tokens each
    ids = torch.randint(3, ref.config.vocab_size, (3, 16))
    inputs = {"input_ids": ids, "position_ids": torch.tensor([[p for n in row for p in range(n)] for row in rows])}
    if offsets:
        lengths = torch.tensor([n for row in rows for n in row])
        inputs["cu_seq_lens_q"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()
        inputs["max_length_q"] = 16
    with forward_context():
        got = ours(**inputs, return_logits=True, use_cache=False)
    expected_loss, ours_loss = 0.0, 0.0
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            alone = ref(input_ids=ids[r:r + 1, start:start + n], use_cache=False)
            assert rel_err(got.logits[r, start:start + n], alone.logits[0]) < tol, (r, start)
            expected_loss = expected_loss + alone.logits.square().mean()
            ours_loss = ours_loss + got.logits[r:r + 1, start:start + n].square().mean()
            start += n
    expected = torch.autograd.grad(expected_loss, list(ref.parameters()))
    ours_loss.backward()
    params = dict(ours.named_parameters())
    for (name, _), grad in zip(ref.named_parameters(), expected):
        # A gradient that cancels to ~1e-11 (Mamba-2's A_log in these tiny configs) differs by the
        # rounding of the terms that cancel, not relative to itself: an absolute floor far below them.
        difference = (params[name].grad.double() - grad.double()).norm().item()
        assert rel_err(params[name].grad, grad) < tol or difference < 1e-12, name
