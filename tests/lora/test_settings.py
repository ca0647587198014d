import pytest

from moetune.lora import LoraSettings


def test_defaults_target_attention_and_experts():
    settings = LoraSettings()
    assert settings.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert settings.target_experts
    assert settings.scaling == settings.alpha / settings.rank


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.0}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"target_modules": [], "target_experts": False}, "target_modules"),
        ({"adapter_dtype": "fp8"}, "adapter_dtype"),
    ],
)
def test_invalid_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LoraSettings.{field}"):
        LoraSettings(**kwargs)
