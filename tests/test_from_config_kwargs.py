"""Transformers v5's ``from_config`` keyword arguments on moetune's own architectures.

``FROM_CONFIG_ARGUMENTS`` in ``moetune/loading_kwargs.py`` is the table of what each does. Here every
accepted argument builds what Transformers' ``AutoModelForCausalLM.from_config`` builds (parameter and
buffer dtypes, torch's default dtype afterwards, the same changes to the caller's config, which the
model holds as Transformers' does), ``experts_implementation`` picks the experts backend as in
``from_pretrained``, and anything else is a TypeError before a model is built.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import pytest
import torch
import transformers
from transformers.integrations import hub_kernels
from transformers.models.auto import auto_factory

import moetune
from moetune.loading_kwargs import FROM_CONFIG_ARGUMENTS
from moetune.models import FAMILIES
from moetune.moe import GroupedExperts
from tests.conftest import tiny_family_config, tiny_qwen3_moe_config

# Fields the model's class fills in: moetune's experts are its own (experts_backend), so the experts
# implementation Transformers' class records for its experts is not compared.
_EXPERTS_FIELD = "_experts_implementation_internal"


def _config(family: str = "qwen3_moe", **fields) -> transformers.PretrainedConfig:
    config = tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_family_config(family)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _fields(config) -> dict:
    return {k: (_fields(v) if isinstance(v, transformers.PretrainedConfig) else v) for k, v in vars(config).items()}


def _build(auto, config, **kwargs):
    """The model, what it changed in ``config`` and torch's default dtype afterwards."""
    before = copy.deepcopy(_fields(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_config(config, **kwargs)
    after = _fields(config)
    changed = {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k) and k != _EXPERTS_FIELD}
    return model, changed, torch.get_default_dtype()


def _dtypes(model) -> dict[str, torch.dtype]:
    return {name: tensor.dtype for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


def _is_moetune(model) -> bool:
    return type(model).__module__.startswith("moetune.")


def _check_like_transformers(family: str, config_fields: dict, kwargs: dict, ours_kwargs: dict | None = None):
    config = _config(family, **config_fields)
    reference, reference_changes, reference_default = _build(transformers.AutoModelForCausalLM, config, **kwargs)
    ours_config = _config(family, **config_fields)
    ours, changes, default = _build(moetune.AutoModelForCausalLM, ours_config, **(kwargs if ours_kwargs is None else ours_kwargs))
    assert _is_moetune(ours) and ours.config is ours_config  # the caller's config, as Transformers' model holds it
    assert changes == reference_changes
    assert default == reference_default == torch.float32
    # Every tensor in Transformers' dtype, DeepSeek-V3's / Nemotron-H's router included: fp32 in
    # Transformers 5.2x, the model's dtype before (the router follows the installed version).
    dtypes, reference_dtypes = _dtypes(ours), _dtypes(reference)
    assert set(dtypes.values()) == set(reference_dtypes.values())
    assert all(reference_dtypes[n] == d for n, d in dtypes.items() if n in reference_dtypes)
    assert ours.config._attn_implementation == reference.config._attn_implementation
    assert ours.config.dtype == reference.config.dtype
    return ours


def test_the_table_covers_every_transformers_argument():
    """What Transformers' from_config and _from_config pop or read (5.10 and 5.25 alike); a new one fails
    this until the table decides what moetune does with it."""
    sources = inspect.getsource(auto_factory._BaseAutoModelClass.from_config) + inspect.getsource(
        transformers.PreTrainedModel._from_config
    )
    taken = set(re.findall(r'kwargs\.(?:pop|get)\(\s*"(\w+)"', sources))
    table = {argument.name for argument in FROM_CONFIG_ARGUMENTS}
    assert {"trust_remote_code", "dtype", "torch_dtype", "attn_implementation", "experts_implementation"} <= taken
    assert taken <= table, sorted(taken - table)
    assert len(table) == len(FROM_CONFIG_ARGUMENTS)


CASES = {
    "nothing": ({}, {}),
    "dtype": ({}, {"dtype": torch.bfloat16}),
    "dtype-name": ({}, {"dtype": "float16"}),
    "dtype-None": ({}, {"dtype": None}),
    "dtype-None-over-config": ({"dtype": torch.bfloat16}, {"dtype": None}),
    "config-dtype": ({"dtype": torch.bfloat16}, {}),
    "torch_dtype": ({}, {"torch_dtype": torch.float16}),
    "torch_dtype-name": ({}, {"torch_dtype": "bfloat16"}),
    "dtype-wins": ({}, {"dtype": torch.bfloat16, "torch_dtype": torch.float16}),
    "torch_dtype-wins-over-config's": ({"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "torch_dtype": torch.float16}),
    "trust_remote_code": ({}, {"trust_remote_code": True}),
    "attn_implementation": ({}, {"attn_implementation": "eager"}),
    "attn_implementation-None": ({}, {"attn_implementation": None}),
    "config-attention": ({"_attn_implementation": "eager"}, {}),
}


@pytest.mark.parametrize(("config_fields", "kwargs"), list(CASES.values()), ids=list(CASES))
def test_arguments_build_what_transformers_builds(config_fields, kwargs):
    _check_like_transformers("qwen3_moe", config_fields, kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kwargs", [{}, {"dtype": "bfloat16", "attn_implementation": "eager"}], ids=["defaults", "dtype"])
def test_every_family_builds_what_transformers_builds(family, kwargs):
    _check_like_transformers(family, {}, kwargs)


@pytest.mark.parametrize("config_fields", [{}, {"dtype": torch.bfloat16}], ids=["config-without-dtype", "bf16-config"])
@pytest.mark.parametrize("name", ["dtype", "torch_dtype"])
def test_auto_dtype_is_the_configs(config_fields, name):
    """'auto' (which Transformers' from_config does not take) builds what leaving the dtype out builds."""
    _check_like_transformers("qwen3_moe", config_fields, {}, ours_kwargs={name: "auto"})


def test_default_dtype_is_restored_and_followed():
    """Built with the dtype as torch's default, which is restored afterwards, on errors too; without
    one, torch's default at the call, as Transformers does."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), dtype=torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float64
        model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
        reference = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
        assert {p.dtype for p in model.parameters()} == {p.dtype for p in reference.parameters()} == {torch.float64}
        with pytest.raises(ValueError, match="not a floating-point dtype"):
            moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), dtype=torch.int32)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "bogus"}, "dtype 'bogus' is not a torch dtype"),
        ({"torch_dtype": "Tensor"}, "torch_dtype 'Tensor' is not a torch dtype"),
        ({"dtype": 16}, "dtype must be a torch.dtype, a string naming one, or 'auto'; got 16"),
    ],
)
def test_bad_dtypes_name_the_argument(kwargs, message):
    """Transformers raises an AttributeError from getattr(torch, name) for these."""
    config = tiny_qwen3_moe_config()
    with pytest.raises(ValueError, match=message):
        moetune.AutoModelForCausalLM.from_config(config, **kwargs)
    assert config.dtype is None


@pytest.mark.parametrize(("implementation", "backend"), [("eager", "loop"), ("grouped_mm", "auto"), ("moetune", "auto")])
def test_experts_implementation_picks_the_matching_experts_backend(implementation, backend):
    """As from_pretrained (experts_backend_for), on the family's own experts."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), experts_implementation=implementation)
    assert {m.backend for m in model.modules() if isinstance(m, GroupedExperts)} == {backend}
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), experts_implementation="eager", experts_backend="loop")
    assert {m.backend for m in model.modules() if isinstance(m, GroupedExperts)} == {"loop"}


def test_experts_implementation_errors_and_warnings():
    with pytest.warns(UserWarning, match="experts_implementation='batched_mm' is a kernel for Transformers' experts"):
        model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), experts_implementation="batched_mm")
    assert {m.backend for m in model.modules() if isinstance(m, GroupedExperts)} == {"auto"}
    with pytest.raises(ValueError, match="experts_implementation='magic' is not one of Transformers'"):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), experts_implementation="magic")
    with pytest.raises(ValueError, match="contradicts experts_backend='triton'"):
        moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), experts_implementation="eager", experts_backend="triton")


def test_allow_all_kernels_applies_while_the_model_is_built(monkeypatch):
    """Transformers' _from_config means it so (Hub kernels for attn_implementation), but leaves it in the
    arguments of the model's __init__, a TypeError there; here it is honoured."""
    seen = []
    model_class = FAMILIES["qwen3_moe"].causal_lm
    check = model_class._check_and_adjust_attn_implementation

    def spy(self, *args, **kwargs):
        seen.append(hub_kernels.ALLOW_ALL_KERNELS)
        return check(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "_check_and_adjust_attn_implementation", spy)
    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), allow_all_kernels=True)
    assert _is_moetune(model) and seen == [True] and hub_kernels.ALLOW_ALL_KERNELS is False
    moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(), allow_all_kernels=False)
    assert seen == [True, False]


def test_moetune_options_and_ignored_arguments_are_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = moetune.AutoModelForCausalLM.from_config(
            tiny_qwen3_moe_config(), device_mesh=None, ep_size=1, trust_remote_code=False, code_revision="main",
            experts_backend="loop",
        )  # fmt: skip
    assert _is_moetune(model) and {m.backend for m in model.modules() if isinstance(m, GroupedExperts)} == {"loop"}


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"foo": 1}, r"it takes trust_remote_code, code_revision, dtype, torch_dtype, attn_implementation"),
        ({"num_hidden_layers": 1}, r"num_hidden_layers: config fields, which from_config does not override"),
        ({"device_map": "cpu", "revision": "main"}, r"device_map, revision: from_pretrained's loading arguments"),
        ({"tp_plan": "auto", "use_kernels": True}, r"tp_plan, use_kernels: from_pretrained's loading arguments"),
    ],
    ids=["unknown", "config-field", "loading", "refused-loading"],
)
def test_other_arguments_are_a_type_error_as_in_transformers(kwargs, hint, monkeypatch):
    config = tiny_qwen3_moe_config()
    with pytest.raises(TypeError):
        transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
    monkeypatch.setattr(FAMILIES["qwen3_moe"].causal_lm, "_from_config", lambda *a, **k: pytest.fail("built"))
    names = re.escape(str(sorted(kwargs)))
    with pytest.raises(TypeError, match=rf"from_config\(\) got unexpected keyword arguments {names} for moetune's qwen3_moe.*{hint}"):
        moetune.AutoModelForCausalLM.from_config(config, **kwargs)
    assert _fields(config) == _fields(tiny_qwen3_moe_config())  # refused before anything was set


def test_other_architectures_get_transformers_from_config_unchanged():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    model = moetune.AutoModelForCausalLM.from_config(config, dtype="bfloat16", attn_implementation="eager")
    assert type(model) is transformers.LlamaForCausalLM and model.config is config and model.dtype == torch.bfloat16
    assert config._attn_implementation == "eager"
    with pytest.raises(TypeError, match=r"LlamaForCausalLM.__init__\(\) got an unexpected keyword argument 'foo'"):
        moetune.AutoModelForCausalLM.from_config(config, foo=1)
