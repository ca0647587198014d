"""moetune's model classes where code written for Transformers' classes uses them directly (and where
Transformers' own model tests do): loading through the class, the experts-implementation API, compiled
generation, and what Transformers inspects on a class (bases, forward signature, recorded outputs).
Tiny fp32 configs on CPU, the four families against Transformers' model holding the same weights."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.generation import CompileConfig, GenerationMixin
from transformers.utils.output_capturing import OutputRecorder

import moetune
from moetune.models import FAMILIES
from moetune.moe import GroupedExperts
from tests.conftest import family_reference, parity_batch, rel_err, save_with_transformers, tiny_family_config, tiny_qwen3_moe_config

TOL = 1e-5
NAMES = list(FAMILIES)
ROUTER_CLASS = {"qwen3_moe": "SoftmaxTopKRouter", "deepseek_v3": "GroupLimitedSigmoidRouter",
                "gpt_oss": "TopKThenSoftmaxRouter", "nemotron_h": "GroupLimitedSigmoidRouter"}  # fmt: skip


def _config(family: str, **overrides):
    return tiny_qwen3_moe_config(**overrides) if family == "qwen3_moe" else tiny_family_config(family, **overrides)


def _hub_checkpoint(family: str, tmp_path):
    """Transformers' model and the folder it saved (its per-expert Hub layout)."""
    ref = family_reference(family).eval()
    return ref, save_with_transformers(ref, tmp_path)


def _tensor_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def _backends(model) -> set[str]:
    return {m.backend for m in model.modules() if isinstance(m, GroupedExperts)}


@pytest.mark.parametrize("family", NAMES)
def test_class_from_pretrained_loads_as_moetune_auto_class(family, tmp_path):
    """``Qwen3MoeForCausalLM.from_pretrained`` (moetune's class) once ran Transformers' loader, which does
    not fuse a Hub checkpoint's per-expert tensors into moetune's classes: the experts came back as
    initialised, with only a load-report warning. The class and its backbone load what
    ``moetune.AutoModelForCausalLM`` loads, from files and from an in-memory state dict."""
    ref, folder = _hub_checkpoint(family, tmp_path)
    causal_lm, backbone = FAMILIES[family].causal_lm, FAMILIES[family].base_model
    auto = moetune.AutoModelForCausalLM.from_pretrained(folder)
    via_class = causal_lm.from_pretrained(folder)
    state_dict = {name: tensor.clone() for name, tensor in ref.state_dict().items()}
    via_state_dict = causal_lm.from_pretrained(None, config=ref.config, state_dict=state_dict)
    assert type(via_class) is causal_lm and type(via_state_dict) is causal_lm
    expected = auto.state_dict()
    for model in (via_class, via_state_dict):
        assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
    ids = parity_batch(ref.config.vocab_size, padded=False)[0]
    with torch.no_grad():
        assert rel_err(via_class(ids).logits, ref(ids).logits) < TOL
        with pytest.warns(UserWarning, match="lm_head.weight"):  # the head is not the backbone's: reported
            loaded_backbone = backbone.from_pretrained(folder)
        assert type(loaded_backbone) is backbone
        assert rel_err(loaded_backbone(ids).last_hidden_state, ref.model(ids).last_hidden_state) < TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_backbone_writes_the_hub_layout_that_transformers_reads(family, tmp_path):
    """The backbone saves as the causal LM does (experts one by one, as on the Hub; Transformers' own
    writer would save moetune's class, custom code to it, in the fused layout), and both moetune's
    class and Transformers' ``AutoModel`` read it back."""
    ref, folder = _hub_checkpoint(family, tmp_path)
    backbone = FAMILIES[family].base_model.from_pretrained(folder, output_loading_info=True)[0]
    backbone.save_pretrained(tmp_path / "backbone")
    keys = _tensor_names(tmp_path / "backbone")
    assert any(".experts.0." in key for key in keys) and not any(key.endswith("experts.down_proj") for key in keys)
    assert not any(key.startswith(("model.", "lm_head")) for key in keys)
    ids = parity_batch(ref.config.vocab_size, padded=False)[0]
    with torch.no_grad():
        expected = ref.model(ids).last_hidden_state
        for model in (FAMILIES[family].base_model.from_pretrained(tmp_path / "backbone"),
                      transformers.AutoModel.from_pretrained(tmp_path / "backbone")):  # fmt: skip
            assert rel_err(model(ids).last_hidden_state, expected) < TOL


@pytest.mark.parametrize("family", NAMES)
def test_every_tensor_has_the_dtype_transformers_gives_it(family, tmp_path):
    """Transformers loads what its classes name in ``_keep_in_fp32_modules`` (for fp16: GPT-OSS's norms) and
    ``_keep_in_fp32_modules_strict`` (for fp16 and bf16: the DeepSeek-V3 / Nemotron-H routers' correction
    bias, and their weight since Transformers 5.2x) in fp32, the rest in the requested dtype; moetune's
    loader once cast every tensor, and its router's weight was fp32 whatever Transformers' was. Loaded, or
    built from a config, every tensor has the dtype the installed Transformers gives it the same way
    (its ``from_config`` keeps nothing in fp32 for fp16, and before 5.2x left the routers' correction bias
    in the requested dtype)."""
    ref, folder = _hub_checkpoint(family, tmp_path)
    for dtype in (torch.float16, torch.bfloat16):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        expected = {n: t.dtype for n, t in loaded.state_dict().items()}
        if family in ("deepseek_v3", "nemotron_h") or (family == "gpt_oss" and dtype == torch.float16):
            assert torch.float32 in expected.values()
        for ours in (FAMILIES[family].causal_lm.from_pretrained(folder, dtype=dtype),
                     moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)):  # fmt: skip
            assert {n: t.dtype for n, t in ours.state_dict().items()} == expected
        built = transformers.AutoModelForCausalLM.from_config(ref.config, dtype=dtype)
        ours_built = moetune.AutoModelForCausalLM.from_config(ref.config, dtype=dtype)
        assert {n: t.dtype for n, t in ours_built.state_dict().items()} == {n: t.dtype for n, t in built.state_dict().items()}


@pytest.mark.parametrize("family", NAMES)
def test_saves_the_tensor_names_transformers_saves(family, tmp_path):
    """``save_pretrained`` writes what Transformers' writes (its original format, the Hub's): the experts
    one by one, and Nemotron-H's tensors under ``backbone.`` (moetune wrote ``model.``)."""
    _, folder = _hub_checkpoint(family, tmp_path)
    FAMILIES[family].causal_lm.from_pretrained(folder).save_pretrained(tmp_path / "ours")
    assert _tensor_names(tmp_path / "ours") == _tensor_names(folder)


def test_class_from_pretrained_fails_loudly(tmp_path):
    """A checkpoint that moetune's class cannot hold is an error naming what is wrong, never
    parameters left as initialised: a missing expert tensor, another architecture's checkpoint."""
    _, folder = _hub_checkpoint("qwen3_moe", tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    causal_lm = FAMILIES["qwen3_moe"].causal_lm
    with pytest.raises(ValueError, match=r"missing tensors.*experts\.3\.up_proj"):
        causal_lm.from_pretrained(folder)
    _, other = _hub_checkpoint("gpt_oss", tmp_path / "other")
    with pytest.raises(ValueError, match="cannot load a checkpoint of model_type 'gpt_oss'"):
        causal_lm.from_pretrained(other)


@pytest.mark.parametrize("family", NAMES)
def test_set_experts_implementation_maps_onto_moetune_backends(family):
    """Transformers' ``set_experts_implementation`` once raised ("does not support setting experts
    implementation"); its names now switch moetune's experts as ``from_pretrained``'s
    ``experts_implementation`` does, the config records them, and the outputs stay the same."""
    model = FAMILIES[family].causal_lm(_config(family)).eval()
    ids = parity_batch(model.config.vocab_size, padded=False)[0]
    with torch.no_grad():
        expected = model(ids).logits
        model.set_experts_implementation("eager")
        assert _backends(model) == {"loop"} and model.config._experts_implementation == "eager"
        assert rel_err(model(ids).logits, expected) < TOL
        model.set_experts_implementation("grouped_mm")
        assert _backends(model) == {"auto"} and model.config._experts_implementation == "grouped_mm"
    with pytest.warns(UserWarning, match="batched_mm.*moetune's"):  # Transformers' kernel for its own experts
        model.set_experts_implementation("batched_mm")
    assert _backends(model) == {"auto"}
    with pytest.raises(ValueError, match="not_a_kernel"):
        model.set_experts_implementation("not_a_kernel")


@pytest.mark.parametrize("family", NAMES)
def test_builds_from_a_config_transformers_class_has_used(family):
    """Transformers' class records ``grouped_mm`` in the config it is built from; moetune's class built
    from that config next once raised. A config naming ``eager`` builds moetune's experts on the loop."""
    config = _config(family)
    transformers.AutoModelForCausalLM.from_config(config)
    assert config._experts_implementation == "grouped_mm"
    assert _backends(FAMILIES[family].causal_lm(config)) == {"auto"}
    config._experts_implementation = "eager"
    assert _backends(FAMILIES[family].causal_lm(config)) == {"loop"}


@pytest.mark.parametrize("family", NAMES)
def test_classes_declare_what_transformers_inspects(family):
    """What Transformers (and its tests) read off a class: ``GenerationMixin`` among the causal LM's direct
    bases; the backbone's forward signature, in Transformers' order (it was ``forward(*args, **kwargs)``)
    and taking positional arguments in it; the forwards' return types and the flags their ``**kwargs``
    take (Transformers' tests skip output_attentions without them); ``router_logits`` recorded from
    moetune's routers (Transformers' recorder named Transformers' router classes, which moetune's models
    do not have)."""
    causal_lm, backbone = FAMILIES[family].causal_lm, FAMILIES[family].base_model
    theirs = transformers.AutoModel._model_mapping[type(_config(family))]
    assert GenerationMixin in causal_lm.__bases__
    ours_parameters = list(inspect.signature(backbone.forward).parameters)
    theirs_parameters = list(inspect.signature(theirs.forward).parameters)
    assert ours_parameters[: len(theirs_parameters) - 1] == theirs_parameters[:-1]
    assert {"output_router_logits", "return_dict"} <= set(ours_parameters)
    assert backbone.forward.__annotations__["return"] == theirs.forward.__annotations__["return"]
    assert "router_logits" in causal_lm.forward.__annotations__["return"].__args__[0].__dataclass_fields__
    for cls in (causal_lm, backbone):  # the flags the forwards take through **kwargs (output_attentions, ...)
        flags = inspect.signature(cls.forward).parameters["kwargs"].annotation.__args__[0].__annotations__
        assert {"output_attentions", "output_hidden_states"} <= set(flags)
    for cls in (causal_lm, backbone):
        recorder = cls._can_record_outputs["router_logits"]
        assert isinstance(recorder, OutputRecorder) and recorder.target_class.__name__ == ROUTER_CLASS[family]
    model = backbone(_config(family)).eval()
    ids, mask, _ = parity_batch(model.config.vocab_size, padded=True)
    with torch.no_grad():
        second = ours_parameters[2]  # attention_mask, or Nemotron-H's inputs_embeds
        inputs = {"attention_mask": mask, "inputs_embeds": model.get_input_embeddings()(ids)}
        positional = model(ids if second == "attention_mask" else None, inputs[second]).last_hidden_state
        named = model(**({"input_ids": ids} if second == "attention_mask" else {}), **{second: inputs[second]}).last_hidden_state
        assert torch.equal(positional, named)
        router = next(m for m in model.modules() if type(m).__name__ == ROUTER_CLASS[family])
        hidden = torch.randn(3, model.config.hidden_size)
        assert torch.equal(router(hidden)[recorder.index], router(hidden).logits_TE)


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("padded", [False, True])
def test_output_router_logits_argument_wins_over_the_config(family, padded):
    """With the config's ``output_router_logits=True``, an explicit False returns none (Transformers' own
    recording, now declared for moetune's routers, must not report them either), True returns one
    per MoE layer, on moetune's plain path (no mask) and Transformers' (a mask)."""
    model = FAMILIES[family].causal_lm(_config(family, output_router_logits=True)).eval()
    ids, mask, _ = parity_batch(model.config.vocab_size, padded=padded)
    num_moe_layers = sum(isinstance(m, GroupedExperts) for m in model.modules())
    with torch.no_grad():
        assert not model(ids, attention_mask=mask if padded else None, output_router_logits=False).router_logits
        assert len(model(ids, attention_mask=mask if padded else None).router_logits) == num_moe_layers
        # The backbone's output class is Transformers' (without a router_logits field before 5.2x for
        # DeepSeek-V3 and Nemotron-H).
        assert not getattr(model.model(ids, attention_mask=mask if padded else None, output_router_logits=False),
                           "router_logits", None)  # fmt: skip


@pytest.mark.parametrize("family", NAMES)
def test_experts_compile_with_fullgraph(family):
    """``torch.compile(..., fullgraph=True)`` (Transformers' compiled generation) stopped at a
    data-dependent guard (``u0 > 0``) where the experts' loop reads the token counts on the host; the
    compiled experts take a route with static shapes and give the same output and gradients. (The
    eager backend: dynamo's tracing is what is tested, in seconds on CPU.)"""
    model = FAMILIES[family].causal_lm(_config(family)).train()
    block = next(m for m in model.modules() if hasattr(m, "experts") and isinstance(m.experts, GroupedExperts))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)  # decisive routing, non-zero biases
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    expected = block(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend="eager")
    got = compiled(x)
    got = got[0] if isinstance(got, tuple) else got
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    assert rel_err(got, expected) < TOL and rel_err(got_grad, expected_grad) < TOL


@pytest.mark.slow  # ~1-2 min per family on 2 CPU cores: torch.compile of a whole (tiny) model, twice
@pytest.mark.parametrize("family", NAMES)
def test_compiled_generation_matches_eager(family):
    """Transformers' compiled generation (static cache, ``compile_config`` with ``fullgraph=True``,
    forced on CPU) runs moetune's models whole and generates what eager generation does."""
    model = FAMILIES[family].causal_lm(_config(family, output_router_logits=False)).eval()
    ids = parity_batch(model.config.vocab_size, padded=False)[0][:, :5]
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    compile_config._compile_all_devices = True  # Transformers compiles on CUDA only, unless told
    with torch.compiler.set_stance("force_eager"):
        eager = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static",
                                  compile_config=compile_config)  # fmt: skip
    assert hasattr(model, "_compiled_call") and torch.equal(compiled, eager)
