"""``fp8`` through the recipe (``model.fp8``) and the benchmark (``moetune bench --fp8``)."""

from __future__ import annotations

import json

import pytest
import torch

from moetune.bench.cli import main as bench_main
from moetune.models.fp8 import fp8_layers
from moetune.recipe.config_loading import load_config
from moetune.recipe.model_loading import build_model, load_model_config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.fp8", "fp16"], r"config field model.fp8: 'fp16' is not one of \('', 'rowwise', 'blockwise'\)"),
        (["--model.fp8", "rowwise", "--model.fp8_backend", "cuda"], "config field model.fp8_backend: 'cuda' is not one of"),
        (["--model.fp8_backend", "reference"], "config field model.fp8_backend: picks the FP8 kernels: set model.fp8"),
        (["--model.fp8", "rowwise", "--model.fp8_weight_grad", "fp32"], "config field model.fp8_weight_grad: 'fp32' is not one of"),
        (["--model.fp8_weight_grad", "fp8"], "config field model.fp8_weight_grad: picks the FP8 weight gradients"),
    ],
)
def test_recipe_fp8_fields_are_checked_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_recipe_fp8_reaches_the_model():
    config = load_config(overrides=["--model.fp8", "blockwise", "--model.fp8_backend", "reference",
                                    "--model.fp8_weight_grad", "fp8"]).model  # fmt: skip
    model = build_model(config, model_config=load_model_config(config), dtype=torch.float32, device=torch.device("cpu"))
    assert fp8_layers(model)
    settings = {m.fp8 for m in model.modules() if getattr(m, "fp8", None) is not None}
    assert {(s.recipe, s.backend, s.weight_grad) for s in settings} == {("blockwise", "reference", "fp8")}
    plain = load_config().model
    assert not fp8_layers(build_model(plain, model_config=load_model_config(plain), dtype=torch.float32,
                                      device=torch.device("cpu")))  # fmt: skip


def test_bench_fp8_trains_the_moetune_side_in_fp8_and_names_its_results(tmp_path):
    code = bench_main([
        "--config", "tiny", "--layers", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--device", "cpu",
        "--sides", "moetune", "--routing", "real", "--fp8", "rowwise", "--fp8-backend", "reference",
        "--no-chart", "--out", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    [path] = tmp_path.glob("tiny-1l-fp8-rowwise-reference_cpu_*.json")
    data = json.loads(path.read_text())
    assert data["config"]["moetune_options"] == {"fp8": "rowwise", "fp8_backend": "reference", "fp8_weight_grad": "bf16"}
    assert [row["error"] for row in data["rows"]] == [None]
