"""Transformers v5's ``from_pretrained`` keyword arguments on moetune's own architectures.

``moetune/loading_kwargs.py`` is the table of what each does. Here: ``ignore_mismatched_sizes``
reports what Transformers reports and loads everything else, ``state_dict=`` loads tensors given in
memory, ``disable_mmap`` reads files whole, every refused argument is a ValueError naming it before
anything is read, the defaults are accepted silently, and ``quantization_config`` routes as it says.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file

import moetune
from moetune import auto
from moetune.checkpoint import loader
from moetune.loading_kwargs import ARGUMENTS, MOETUNE, REFUSED
from moetune.moe import GroupedExperts
from tests.conftest import quantize_fp8_checkpoint, save_per_expert_checkpoint, tiny_family_config, tiny_qwen3_moe_config


@pytest.fixture
def checkpoint(reference_qwen3_moe, tmp_path):
    return save_per_expert_checkpoint(reference_qwen3_moe(), tmp_path / "ckpt")  # Hub layout, vocab 96


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _is_moetune(model) -> bool:
    return type(model).__module__.startswith("moetune.")


def _never_read(monkeypatch):
    """Fail the test if weights are listed, allocated or read (refusals must come first)."""

    def fail(*_args, **_kwargs):
        raise AssertionError("weights were read before the argument was refused")

    for name in ("list_checkpoint_tensors", "state_dict_tensors", "materialize", "load_checkpoint"):
        monkeypatch.setattr(auto, name, fail)


def _transformers_arguments() -> set[str]:
    """Every argument this Transformers' ``PreTrainedModel.from_pretrained`` names or pops."""
    method = transformers.PreTrainedModel.from_pretrained
    popped = set(re.findall(r'kwargs\.pop\(\s*"(\w+)"', inspect.getsource(method)))
    named = set(inspect.signature(method).parameters) - {"cls", "pretrained_model_name_or_path", "model_args", "kwargs"}
    return popped | named


def test_the_table_covers_every_transformers_argument():
    """5.25 names 43 (with config); 5.10 lacks kernels_mode, tp_plan and tp_size, which moetune handles all
    the same. A new Transformers argument fails this until the table decides what moetune does with it."""
    table = {argument.name for argument in ARGUMENTS}
    assert _transformers_arguments() <= table, sorted(_transformers_arguments() - table)
    assert {"kernels_mode", "tp_plan", "tp_size", "ignore_mismatched_sizes", "state_dict", "disable_mmap"} <= table
    assert len(table) == len(ARGUMENTS)


# ---------------------------------------------------------------- ignore_mismatched_sizes


def test_ignore_mismatched_sizes_reports_and_loads_like_transformers(checkpoint):
    """A larger vocabulary: embeddings and LM head initialised afresh and reported as Transformers
    reports them; every other weight is the checkpoint's."""
    torch.manual_seed(5)
    reference, reference_info = _quiet(
        transformers.AutoModelForCausalLM.from_pretrained, checkpoint, vocab_size=128,
        ignore_mismatched_sizes=True, output_loading_info=True,
    )  # fmt: skip
    torch.manual_seed(5)
    with pytest.warns(UserWarning, match=r"2 parameters .* initialised afresh .*lm_head.weight: \[96, 32\] in the checkpoint, \[128, 32\] here"):
        model, info = moetune.AutoModelForCausalLM.from_pretrained(
            checkpoint, vocab_size=128, ignore_mismatched_sizes=True, output_loading_info=True
        )
    assert _is_moetune(model) and model.config.vocab_size == 128
    assert info["mismatched_keys"] == reference_info["mismatched_keys"] == {
        ("model.embed_tokens.weight", torch.Size([96, 32]), torch.Size([128, 32])),
        ("lm_head.weight", torch.Size([96, 32]), torch.Size([128, 32])),
    }
    assert set(info) == set(reference_info) and not info["missing_keys"] and not info["unexpected_keys"]
    saved = load_file(checkpoint / "model.safetensors")
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, reference_params[name]), name  # loaded ones, and the same fresh draws
        if name in saved:
            assert (name in ("model.embed_tokens.weight", "lm_head.weight")) != torch.equal(param, saved[name]), name
    fresh = model.model.embed_tokens.weight
    assert abs(fresh.std().item() - model.config.initializer_range) < 0.005  # _init_weights' normal(0, 0.02)
    assert not any(hasattr(t, "_is_hf_initialized") for t in [*model.parameters(), *model.modules()])
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [{"moe_intermediate_size": 24}, {"num_experts": 4}, {"num_experts": 10}],
    ids=["expert-size", "fewer-experts", "more-experts"],
)
def test_mismatched_experts_are_reported_as_transformers_stacks_them(checkpoint, overrides):
    """Per-expert Hub tensors are reported under the fused parameter, with the shape they stack to."""
    _, reference_info = _quiet(
        transformers.AutoModelForCausalLM.from_pretrained, checkpoint, ignore_mismatched_sizes=True,
        output_loading_info=True, **overrides,
    )  # fmt: skip
    model, info = _quiet(
        moetune.AutoModelForCausalLM.from_pretrained, checkpoint, ignore_mismatched_sizes=True,
        output_loading_info=True, **overrides,
    )  # fmt: skip
    assert _is_moetune(model)
    assert info["mismatched_keys"] == reference_info["mismatched_keys"] != set()
    saved = load_file(checkpoint / "model.safetensors")
    for name, param in model.named_parameters():
        if "mlp.experts" not in name and "mlp.gate" not in name:
            assert torch.equal(param, saved[name]), name


def test_mismatched_sizes_stay_an_error_without_the_flag(checkpoint, monkeypatch):
    monkeypatch.setattr(auto, "materialize", lambda *a: pytest.fail("allocated before the check"))
    with pytest.raises(ValueError, match=r"mis-shaped tensors \(2\).*ignore_mismatched_sizes=True"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, vocab_size=128)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "nemotron_h"])
def test_the_other_families_reinitialise_only_the_mismatched(family, tmp_path):
    """Their _init_weights (Transformers' and moetune's MoE modules) must leave loaded tensors alone."""
    config = tiny_family_config(family)
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config)
    source.save_pretrained(tmp_path)
    _, reference_info = _quiet(
        transformers.AutoModelForCausalLM.from_pretrained, tmp_path, vocab_size=128, ignore_mismatched_sizes=True,
        output_loading_info=True,
    )  # fmt: skip
    model, info = _quiet(
        moetune.AutoModelForCausalLM.from_pretrained, tmp_path, vocab_size=128, ignore_mismatched_sizes=True,
        output_loading_info=True,
    )  # fmt: skip
    assert _is_moetune(model) and info["mismatched_keys"] == reference_info["mismatched_keys"] != set()
    mismatched = {name for name, _, _ in info["mismatched_keys"]}
    expected = dict(source.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]) != (name in mismatched), name


def _expert_parallel_worker(rank: int, world_size: int, folder: str) -> None:
    """Each rank: mismatched parameters drawn as one process draws them (equal on every rank), the
    rest read from whole files (disable_mmap); a state dict loads into the shards too."""
    import torch.distributed as dist

    expected = dict(moetune.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    torch.manual_seed(0)
    model, info = _quiet(
        moetune.AutoModelForCausalLM.from_pretrained, folder, ep_size=world_size, vocab_size=128,
        ignore_mismatched_sizes=True, output_loading_info=True, disable_mmap=True,
    )  # fmt: skip
    mismatched = {name for name, _, _ in info["mismatched_keys"]}
    assert mismatched == {"model.embed_tokens.weight", "lm_head.weight"}
    for name, param in model.named_parameters():
        full = param.full_tensor()
        if name in mismatched:
            gathered = [torch.empty_like(full) for _ in range(world_size)]
            dist.all_gather(gathered, full.contiguous())
            assert all(torch.equal(g, full) for g in gathered) and abs(full.std().item() - 0.02) < 0.005, name
        else:
            assert torch.equal(full, expected[name]), name
    state_dict = load_file(f"{folder}/model.safetensors")
    config = transformers.AutoConfig.from_pretrained(folder)
    model = moetune.AutoModelForCausalLM.from_pretrained(None, config=config, state_dict=state_dict, ep_size=world_size)
    assert all(torch.equal(param.full_tensor(), expected[name]) for name, param in model.named_parameters())


@pytest.mark.distributed
def test_under_expert_parallelism(checkpoint):
    from tests.distributed.helpers import spawn

    spawn(_expert_parallel_worker, 2, str(checkpoint))


# ---------------------------------------------------------------- state_dict


@pytest.mark.parametrize("layout", ["fused", "hub"])
def test_state_dict_loads_like_files(reference_qwen3_moe, checkpoint, layout):
    """Transformers' form, from_pretrained(None, config=..., state_dict=...): the model's own (fused)
    state dict or the Hub's per-expert tensors; nothing is unpickled or written."""
    reference = reference_qwen3_moe()
    state_dict = reference.state_dict() if layout == "fused" else load_file(checkpoint / "model.safetensors")
    model, info = moetune.AutoModelForCausalLM.from_pretrained(
        None, config=tiny_qwen3_moe_config(), state_dict=state_dict, output_loading_info=True
    )
    assert _is_moetune(model) and not model.training and model.dtype == torch.float32
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name
    bf16 = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
    assert moetune.AutoModelForCausalLM.from_pretrained(None, config=tiny_qwen3_moe_config(), state_dict=bf16).dtype == torch.bfloat16


def test_state_dict_errors_like_transformers(reference_qwen3_moe, checkpoint):
    state_dict = reference_qwen3_moe().state_dict()
    with pytest.raises(ValueError, match="state_dict cannot be passed together with a checkpoint"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, state_dict=state_dict)
    with pytest.raises(ValueError, match="needs config="):
        moetune.AutoModelForCausalLM.from_pretrained(None, state_dict=state_dict)
    with pytest.raises(ValueError, match="pretrained_model_name_or_path is None"):
        moetune.AutoModelForCausalLM.from_pretrained(None, config=tiny_qwen3_moe_config())
    with pytest.raises(TypeError, match="torch.Tensor"):
        moetune.AutoModelForCausalLM.from_pretrained(None, config=tiny_qwen3_moe_config(), state_dict={"a": [1.0]})
    del state_dict["model.norm.weight"]
    with pytest.raises(ValueError, match=r"checkpoint 'state_dict' does not match .*missing tensors \(1\): model.norm.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(None, config=tiny_qwen3_moe_config(), state_dict=state_dict)


def test_state_dict_with_mismatched_sizes(reference_qwen3_moe):
    state_dict = reference_qwen3_moe().state_dict()
    model, info = _quiet(
        moetune.AutoModelForCausalLM.from_pretrained, None, config=tiny_qwen3_moe_config(vocab_size=100),
        state_dict=state_dict, ignore_mismatched_sizes=True, output_loading_info=True,
    )  # fmt: skip
    assert {name for name, _, _ in info["mismatched_keys"]} == {"model.embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(model.model.norm.weight, state_dict["model.norm.weight"])


def test_state_dict_of_another_architecture_goes_to_transformers():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    state_dict = transformers.LlamaForCausalLM(config).state_dict()
    model = _quiet(moetune.AutoModelForCausalLM.from_pretrained, None, config=config, state_dict=state_dict)
    assert type(model) is transformers.LlamaForCausalLM
    assert all(torch.equal(param, state_dict[name]) for name, param in model.named_parameters())


# ---------------------------------------------------------------- disable_mmap


def test_disable_mmap_reads_files_whole(checkpoint, monkeypatch):
    expected = moetune.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    quantize_fp8_checkpoint(checkpoint)  # weights with scales: read through the same reader
    mapped = moetune.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()

    def no_mmap(*_args, **_kwargs):
        raise AssertionError("memory-mapped a file under disable_mmap=True")

    monkeypatch.setattr(loader, "open_safetensors", no_mmap)  # the reader's memory-mapped path
    whole = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, disable_mmap=True).state_dict()
    assert whole.keys() == mapped.keys() == expected.keys()
    assert all(torch.equal(whole[k], mapped[k]) for k in whole)
    assert not all(torch.equal(whole[k], expected[k]) for k in whole)  # the FP8 values did load


# ---------------------------------------------------------------- refused, warned, defaults

REFUSED_VALUES = {
    "max_memory": {0: "10GiB", "cpu": "30GiB"},
    "offload_folder": "/tmp/offload",
    "offload_buffers": True,
    "tp_plan": "auto",
    "tp_size": 2,
    "distributed_config": {"tp_size": 2},
    "adapter_name": "my-adapter",
    "adapter_kwargs": {"revision": "main"},
    "use_safetensors": False,
}


def test_every_refused_argument_is_tested():
    assert set(REFUSED_VALUES) == {a.name for a in ARGUMENTS if a.treatment == REFUSED}


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_arguments_name_themselves_before_any_weight_is_read(checkpoint, monkeypatch, name):
    _never_read(monkeypatch)
    with pytest.raises(ValueError, match=rf"from_pretrained\({name}=.* is not supported for moetune's qwen3_moe"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, **{name: REFUSED_VALUES[name]})


def test_refused_arguments_say_what_to_use_instead(checkpoint):
    for name, alternative in [("max_memory", "ep_size"), ("tp_size", "ep_size"), ("adapter_name", "load_peft_adapter"),
                              ("use_safetensors", "never unpickles")]:  # fmt: skip
        with pytest.raises(ValueError, match=alternative):
            moetune.AutoModelForCausalLM.from_pretrained(checkpoint, **{name: REFUSED_VALUES[name]})


def test_defaults_are_accepted_silently(checkpoint):
    """Code that spells out Transformers' defaults (or passes what pipelines pass) keeps working."""
    defaults = {
        "max_memory": None, "offload_folder": None, "offload_buffers": False, "tp_plan": None, "tp_size": None,
        "distributed_config": None, "gguf_file": None, "adapter_name": "default", "adapter_kwargs": {},
        "use_safetensors": True, "weights_only": True, "use_kernels": False, "kernel_config": None, "kernels_mode": None,
        "allow_all_kernels": False, "_commit_hash": "0123abcd", "_from_pipeline": "text-generation", "_from_auto": True,
        "tqdm_class": None, "disable_mmap": None, "fusion_config": None, "quantization_config": None, "state_dict": None,
        "experts_implementation": None, "ignore_mismatched_sizes": False, "low_cpu_mem_usage": True, "proxies": None,
        "subfolder": "", "revision": None, "local_files_only": True, "force_download": False, "key_mapping": None,
        "generation_config": None, "variant": None, "trust_remote_code": False, "device_mesh": None, "from_tf": False,
    }  # fmt: skip
    assert {a.name for a in ARGUMENTS if a.treatment in (REFUSED, MOETUNE)} <= set(defaults)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, **defaults)
        model_with_none = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, use_safetensors=None, use_kernels=None)
    plain = moetune.AutoModelForCausalLM.from_pretrained(checkpoint)
    for loaded in (model, model_with_none):
        assert _is_moetune(loaded)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), plain.state_dict().values()))


def test_transformers_hub_kernels_are_not_applied_with_a_warning(checkpoint):
    with pytest.warns(UserWarning, match="use_kernels: Transformers' Hub kernels are not applied to moetune's qwen3_moe"):
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True, allow_all_kernels=True)
    assert _is_moetune(model)
    with pytest.warns(UserWarning, match="kernel_config, kernels_mode: Transformers' Hub kernels are not applied"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, kernel_config=object(), kernels_mode="training")


@pytest.mark.parametrize(
    ("implementation", "backend"), [("eager", "loop"), ("grouped_mm", "auto"), ("moetune", "auto")]
)
def test_experts_implementation_picks_the_matching_experts_backend(checkpoint, implementation, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation=implementation)
    backends = {m.backend for m in model.modules() if isinstance(m, GroupedExperts)}
    assert backends == {backend}


def test_experts_implementation_errors_and_warnings(checkpoint, monkeypatch):
    with pytest.warns(UserWarning, match="experts_implementation='batched_mm' is a kernel for Transformers' experts"):
        model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="batched_mm")
    assert {m.backend for m in model.modules() if isinstance(m, GroupedExperts)} == {"auto"}
    _never_read(monkeypatch)
    with pytest.raises(ValueError, match="experts_implementation='magic' is not one of Transformers'"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="magic")
    with pytest.raises(ValueError, match="contradicts experts_backend='triton'"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="eager", experts_backend="triton")


def test_fusion_config_is_recorded_as_transformers_records_it(checkpoint, monkeypatch):
    model = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, fusion_config={"patch_embeddings": True})
    assert _is_moetune(model) and model.config.fusion_config == {"patch_embeddings": True}
    _never_read(monkeypatch)
    with pytest.raises(ValueError, match=r"unknown fusion type\(s\) \['bogus'\]"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, fusion_config={"bogus": True})


def test_device_maps_over_several_devices_are_refused(checkpoint):
    for device_map in ("balanced", "sequential", {"": "disk"}):
        with pytest.raises(ValueError, match="one device"):
            moetune.AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map)


def test_a_peft_adapter_folder_says_how_to_load_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "org/base"}')
    with pytest.raises(FileNotFoundError, match="PEFT adapter.*load_peft_adapter"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_hub_download_fetches_the_config_first_and_takes_tqdm_class(checkpoint, monkeypatch):
    """A refused argument stops a Hub load after the JSON files, before the weights are downloaded."""
    import huggingface_hub

    calls = []

    def fake_download(*, repo_id, allow_patterns, **kwargs):
        calls.append((repo_id, tuple(allow_patterns), kwargs.get("tqdm_class")))
        return str(checkpoint)

    class Bar:  # a tqdm stand-in
        pass

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model = moetune.AutoModelForCausalLM.from_pretrained("org/model", tqdm_class=Bar)
    assert _is_moetune(model) and [c[1] for c in calls] == [("*.json",), auto.CHECKPOINT_PATTERNS]
    assert all(c[0] == "org/model" and c[2] is Bar for c in calls)
    calls.clear()
    with pytest.raises(ValueError, match="max_memory"):
        moetune.AutoModelForCausalLM.from_pretrained("org/model", max_memory={0: "1GiB"})
    assert [c[1] for c in calls] == [("*.json",)]
    calls.clear()
    moetune.AutoModelForCausalLM.from_pretrained("org/model", trust_remote_code=True)  # a remote config class's file
    assert [c[1] for c in calls] == [("*.json", "*.py"), auto.CHECKPOINT_PATTERNS] and "*.py" in auto.CHECKPOINT_PATTERNS


def test_allow_all_kernels_builds_the_model_under_transformers_switch(checkpoint, monkeypatch):
    """As Transformers: the model's attention may then name any Hub kernel (the switch is entered around
    the build, in from_pretrained as in from_config)."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(True)
        yield

    monkeypatch.setattr(auto, "allow_all_hub_kernels", recording)
    assert _is_moetune(moetune.AutoModelForCausalLM.from_pretrained(checkpoint, allow_all_kernels=True))
    assert _is_moetune(moetune.AutoModelForCausalLM.from_pretrained(checkpoint))
    assert entered == [True]


# ---------------------------------------------------------------- quantization_config and gguf_file


def _capture_transformers_load(monkeypatch) -> list:
    calls = []

    def fake_from_pretrained(path, *args, **kwargs):
        calls.append((path, kwargs))
        return "transformers' model"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    return calls


def test_quantizing_while_loading_goes_to_transformers(checkpoint, monkeypatch):
    """bitsandbytes & co. quantize Transformers' layers: Transformers' class gets the argument."""
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True)
    calls = _capture_transformers_load(monkeypatch)
    with pytest.warns(UserWarning, match=r"quant_method='bitsandbytes'\) asks to quantize the weights while loading"):
        loaded = moetune.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization)
    assert loaded == "transformers' model"
    (path, kwargs), = calls
    assert path == checkpoint and kwargs["quantization_config"] is quantization
    assert getattr(kwargs["config"], "quantization_config", None) is None  # not taken for a config field
    with pytest.raises(ValueError, match="ep_size / device_mesh need an architecture moetune implements"), pytest.warns(UserWarning):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization, ep_size=2)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_quantizing_while_loading_without_the_package_errors_clearly(checkpoint):
    with pytest.raises(ImportError, match="bitsandbytes"):
        _quiet(moetune.AutoModelForCausalLM.from_pretrained, checkpoint,
               quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True))  # fmt: skip


def test_dequantize_true_loads_moetunes_model(checkpoint, monkeypatch):
    """FP8 block-scaled weights that moetune dequantizes anyway: FineGrainedFP8Config(dequantize=True)
    gives moetune's model with plain weights; without dequantize=True Transformers keeps them FP8."""
    quantize_fp8_checkpoint(checkpoint)
    expected = moetune.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = moetune.AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
        )
    assert _is_moetune(model) and getattr(model.config, "quantization_config", None) is None
    assert all(torch.equal(a, expected[k]) for k, a in model.state_dict().items())
    calls = _capture_transformers_load(monkeypatch)
    with pytest.warns(UserWarning, match="keeps it quantized"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=transformers.FineGrainedFP8Config())
    assert len(calls) == 1


def test_mxfp4_dequantize_true_loads_moetunes_model(tmp_path):
    """GPT-OSS's Hub recipe, quantization_config=Mxfp4Config(dequantize=True)."""
    from tests.test_gpt_oss_parity import _mxfp4_checkpoint

    reference, folder = _mxfp4_checkpoint(tmp_path)
    model = moetune.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    assert _is_moetune(model) and getattr(model.config, "quantization_config", None) is None
    expected = dict(reference.named_parameters())
    assert all(torch.equal(param, expected[name]) for name, param in model.named_parameters())


def test_gguf_file_goes_to_transformers(checkpoint, monkeypatch):
    calls = _capture_transformers_load(monkeypatch)
    with pytest.warns(UserWarning, match="GGUF file loads through Transformers' class"):
        assert moetune.AutoModelForCausalLM.from_pretrained(checkpoint, gguf_file="model-Q4_K_M.gguf") == "transformers' model"
    assert calls[0][1]["gguf_file"] == "model-Q4_K_M.gguf"
    with pytest.raises(ValueError, match="gguf_file loads through Transformers' class, which takes none of moetune's options"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint, gguf_file="model-Q4_K_M.gguf", experts_backend="loop")


def test_save_and_reload_after_a_resize(checkpoint, tmp_path):
    """What a resized model saves loads back without the flag, in moetune and in Transformers."""
    model = _quiet(moetune.AutoModelForCausalLM.from_pretrained, checkpoint, vocab_size=128, ignore_mismatched_sizes=True)
    model.save_pretrained(tmp_path / "resized")
    again = moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "resized")
    plain = _quiet(transformers.AutoModelForCausalLM.from_pretrained, tmp_path / "resized")
    for name, param in again.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name
        assert torch.equal(param, dict(plain.named_parameters())[name]), name


def test_output_loading_info_takes_transformers_semantics_for_what_it_reports(reference_qwen3_moe, checkpoint):
    """A caller who asks for Transformers' loading report gets what Transformers does with it: tensors the
    checkpoint lacks are initialised (model's init) and listed in missing_keys, tensors no parameter takes are
    listed in unexpected_keys, the rest loads. Without the report either stays a ValueError naming them."""
    reference = reference_qwen3_moe()
    state_dict = {**reference.state_dict(), "extra.weight": torch.ones(2)}
    del state_dict["model.norm.weight"], state_dict["model.layers.0.mlp.experts.gate_up_proj"]
    config = tiny_qwen3_moe_config()
    with pytest.raises(ValueError, match=r"missing tensors \(17\): .*unexpected tensors \(1\): extra.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(None, config=config, state_dict=state_dict)
    with pytest.warns(UserWarning, match="initialised afresh"):
        model, info = moetune.AutoModelForCausalLM.from_pretrained(
            None, config=config, state_dict=state_dict, output_loading_info=True
        )
    assert info["missing_keys"] == {"model.norm.weight", "model.layers.0.mlp.experts.gate_up_proj"}
    assert info["unexpected_keys"] == {"extra.weight"}
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))  # RMSNorm's init
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.abs().sum() > 0 and not torch.equal(experts, reference.model.layers[0].mlp.experts.gate_up_proj)
    loaded = reference.model.layers[0].mlp.experts.down_proj
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, loaded)


def test_a_backbone_checkpoint_loads_into_the_causal_lm_under_its_prefix(reference_qwen3_moe, tmp_path):
    """Transformers bridges a backbone's checkpoint and a causal LM by ``base_model_prefix``: the backbone's
    tensors load under ``model.``; the head, which such a checkpoint lacks, is reported by name (an error,
    or initialised with ``output_loading_info``)."""
    reference = reference_qwen3_moe()
    reference.model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing tensors \(1\): lm_head.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(tmp_path)
    model, info = _quiet(moetune.AutoModelForCausalLM.from_pretrained, tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, reference.model.layers[0].mlp.experts.gate_up_proj)


def test_the_device_of_a_torch_device_block_places_the_model(checkpoint):
    """Transformers' rule without a device_map: the model goes where a ``with torch.device(...)`` block says,
    and the meta device is refused (loading is for existing weights)."""
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta device context manager"):
        moetune.AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.device("cpu"):
        assert moetune.AutoModelForCausalLM.from_pretrained(checkpoint).device.type == "cpu"
