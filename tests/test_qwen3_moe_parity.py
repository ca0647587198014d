"""moetune's Qwen3-MoE equals Transformers' on tiny fp32 configs: logits, loss (+aux), gradients,
generation, in both checkpoint layouts; plain Transformers loads what moetune saves; and
from_pretrained / save_pretrained take config, attn_implementation, key_mapping and variant as
Transformers does."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import moetune
from moetune.models.qwen3_moe.model import Qwen3MoeForCausalLM
from tests.conftest import (
    check_bf16_training_parity,
    check_fused_loss_and_gradients,
    forbid_qwen3_mask_preparation,
    parity_batch,
    rel_err,
    save_per_expert_checkpoint,
)

TOL = 1e-5
CONFIGS = {
    "dense-layer-renorm": {},
    "no-renorm": {"norm_topk_prob": False, "mlp_only_layers": []},
    "sparse-step-2-tied": {"decoder_sparse_step": 2, "mlp_only_layers": [], "tie_word_embeddings": True},
}


def _save(ref, tmp_path, layout: str):
    folder = tmp_path / layout
    if layout == "per-expert":
        return save_per_expert_checkpoint(ref, folder)
    if layout == "per-expert-sharded":
        return save_per_expert_checkpoint(ref, folder, max_tensors_per_shard=7)
    ref.save_pretrained(folder, save_original_format=False)
    return folder


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unmasked_training_batches_take_the_plain_causal_path(reference_qwen3_moe, tmp_path, name, monkeypatch):
    """No mask, no position ids, no cache: moetune's decoder loop runs without Transformers' mask
    preparation (which syncs with the host) and equals Transformers' logits, loss and gradients."""
    ref = reference_qwen3_moe(**CONFIGS[name])
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "fused"))
    ref.train()
    ours.train()
    ids, _, labels = parity_batch(ref.config.vocab_size, padded=False)
    expected = ref(input_ids=ids, labels=labels)
    forbid_qwen3_mask_preparation(monkeypatch, "the plain causal path must not prepare a mask")
    with torch.no_grad():
        got = ours(input_ids=ids, labels=labels, return_logits=True)
    assert rel_err(got.logits, expected.logits) < TOL
    assert rel_err(got.loss, expected.loss) < TOL
    assert rel_err(got.aux_loss, expected.aux_loss) < TOL
    check_fused_loss_and_gradients(ours, ref, expected.loss, TOL, input_ids=ids, labels=labels)
    with pytest.raises(AssertionError, match="must not prepare"):  # a mask still goes through Transformers
        ours(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["per-expert", "fused", "per-expert-sharded"])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_backward_parity(reference_qwen3_moe, tmp_path, name, layout, padded):
    ref = reference_qwen3_moe(**CONFIGS[name])
    folder = _save(ref, tmp_path, layout)
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(ours, Qwen3MoeForCausalLM) and isinstance(ours, transformers.PreTrainedModel)
    assert ours.dtype == torch.float32
    ref.train()
    ours.train()
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=padded)

    expected = ref(input_ids=ids, attention_mask=mask, labels=labels)
    got = ours(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True)
    keep = mask.bool()  # padded positions are not compared: they are masked out of everything
    assert rel_err(got.logits[keep], expected.logits[keep]) < TOL
    assert rel_err(got.loss, expected.loss) < TOL
    assert rel_err(got.aux_loss, expected.aux_loss) < TOL

    # The training default: fused LM-head loss.
    check_fused_loss_and_gradients(ours, ref, expected.loss, input_ids=ids, attention_mask=mask, labels=labels)


def test_greedy_generation_matches(reference_qwen3_moe, tmp_path):
    # Transformers' own aux loss fails under generate with a padded KV-cache mask, so routers'
    # logits are not requested here (moetune handles that case; see test_aux_loss_under_generate).
    ref = reference_qwen3_moe(output_router_logits=False).eval()
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "per-expert"))
    ids, mask, _ = parity_batch(ref.config.vocab_size, padded=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(
        ours.generate(input_ids=ids, attention_mask=mask, **kwargs),
        ref.generate(input_ids=ids, attention_mask=mask, **kwargs),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("save_original_format", [True, False])
def test_moetune_save_loads_in_plain_transformers(reference_qwen3_moe, tmp_path, save_original_format):
    ref = reference_qwen3_moe().eval()
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "fused"))
    out = tmp_path / "saved"
    ours.save_pretrained(out, save_original_format=save_original_format, max_shard_size="40KB")
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "generation_config.json" in files
    assert "model.safetensors.index.json" in files  # sharded
    from moetune.checkpoint import list_checkpoint_tensors

    keys = list_checkpoint_tensors(out)
    assert ("model.layers.0.mlp.experts.3.gate_proj.weight" in keys) == save_original_format
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (not save_original_format)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(plain) is transformers.Qwen3MoeForCausalLM
    ids, mask, _ = parity_batch(ref.config.vocab_size, padded=False)
    torch.testing.assert_close(plain(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)


def test_save_pretrained_pushes_the_saved_checkpoint_to_the_hub(reference_qwen3_moe, tmp_path, monkeypatch):
    """``save_pretrained(..., push_to_hub=True)``: the repo is created under the id the Hub returns and
    the folder uploaded is the Transformers-loadable checkpoint just written. The Hub client is a
    recording stand-in (tests have no network); what it is handed is checked, and the folder loads."""
    import huggingface_hub
    from huggingface_hub import RepoUrl

    calls = []

    class RecordingHfApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))
            return RepoUrl(f"https://huggingface.co/someone/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, commit_message=None, commit_description=None, revision=None,
                          create_pr=False):  # fmt: skip
            calls.append(("upload_folder", repo_id, commit_message, commit_description, revision, create_pr))
            uploaded = transformers.AutoModelForCausalLM.from_pretrained(folder_path)  # complete on upload
            calls.append(("loaded", type(uploaded).__name__))

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(reference_qwen3_moe(), tmp_path, "fused"))
    ours.save_pretrained(tmp_path / "tiny-moe", push_to_hub=True, token="hf_x", private=True, commit_message="v1")
    assert calls == [
        ("init", "hf_x"),
        ("create_repo", "tiny-moe", True, True),
        ("upload_folder", "someone/tiny-moe", "v1", None, None, False),
        ("loaded", "Qwen3MoeForCausalLM"),
    ]
    calls.clear()
    ours.save_pretrained(tmp_path / "other", push_to_hub=True, repo_id="org/named", is_main_process=False)
    assert calls == []  # only the main process talks to the Hub


def test_from_config_matches_transformers_init_scheme():
    cfg = moetune_cfg = __import__("tests.conftest", fromlist=["x"]).tiny_qwen3_moe_config()
    model = moetune.AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, Qwen3MoeForCausalLM)
    experts = model.model.layers[0].mlp.experts
    std = moetune_cfg.initializer_range
    assert abs(experts.gate_up_proj.std().item() - std) < 0.3 * std
    assert abs(model.model.layers[0].mlp.gate.weight.std().item() - std) < 0.3 * std
    torch.testing.assert_close(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate_proj.weight" in names


def test_dtype_and_config_overrides(reference_qwen3_moe, tmp_path):
    folder = _save(reference_qwen3_moe(), tmp_path, "fused")
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, router_aux_loss_coef=0.5)
    assert model.dtype == torch.bfloat16 and model.config.router_aux_loss_coef == 0.5
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype="bfloat16", device_map="cpu")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert not model.training  # Transformers returns models in eval mode


def test_an_explicit_config_is_copied_not_changed_or_shared(reference_qwen3_moe, tmp_path):
    """Like Transformers, from_pretrained(config=cfg) loads into a copy: the caller's config keeps its
    fields and a second load with it does not inherit the first one's dtype. from_config shares
    the config exactly when Transformers' from_config does (it does not copy in 5.10 / 5.25)."""
    folder = _save(reference_qwen3_moe(), tmp_path, "fused")
    config = transformers.AutoConfig.from_pretrained(folder)
    before = config.to_dict()
    first = moetune.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.bfloat16)
    second = moetune.AutoModelForCausalLM.from_pretrained(folder, config=config)
    assert first.dtype == torch.bfloat16 and second.dtype == torch.float32
    assert config.to_dict() == before
    assert first.config is not config and second.config is not config and first.config is not second.config
    theirs = transformers.AutoConfig.from_pretrained(folder)
    ours = transformers.AutoConfig.from_pretrained(folder)
    shared_by_transformers = transformers.AutoModelForCausalLM.from_config(theirs).config is theirs
    assert (moetune.AutoModelForCausalLM.from_config(ours).config is ours) == shared_by_transformers


def test_attention_named_in_the_config_is_used(reference_qwen3_moe, tmp_path):
    """AutoConfig.from_pretrained(..., attn_implementation="eager") chooses the attention for
    from_config and from_pretrained(config=) too; an explicit argument still wins."""
    folder = _save(reference_qwen3_moe(), tmp_path, "fused")
    config = transformers.AutoConfig.from_pretrained(folder, attn_implementation="eager")
    assert moetune.AutoModelForCausalLM.from_config(config).config._attn_implementation == "eager"
    assert moetune.AutoModelForCausalLM.from_pretrained(folder, config=config).config._attn_implementation == "eager"
    chosen = moetune.AutoModelForCausalLM.from_pretrained(folder, config=config, attn_implementation="sdpa")
    assert chosen.config._attn_implementation == "sdpa"
    assert moetune.AutoModelForCausalLM.from_pretrained(folder).config._attn_implementation == "sdpa"  # the default


def test_config_given_as_a_path(reference_qwen3_moe, tmp_path):
    """config=<folder or config.json> is loaded (not handed to Transformers' class), and the keyword
    arguments left over override its fields, as Transformers' model classes do."""
    folder = _save(reference_qwen3_moe(), tmp_path, "fused")
    transformers.AutoConfig.from_pretrained(folder, router_aux_loss_coef=0.5).save_pretrained(tmp_path / "other")
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, config=str(tmp_path / "other"), experts_backend="loop")
    assert isinstance(model, Qwen3MoeForCausalLM) and model.config.router_aux_loss_coef == 0.5
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, config=tmp_path / "other" / "config.json", use_cache=False)
    assert isinstance(model, Qwen3MoeForCausalLM) and model.config.router_aux_loss_coef == 0.5 and not model.config.use_cache
    with pytest.raises(FileNotFoundError, match="nowhere"):
        moetune.AutoModelForCausalLM.from_pretrained(folder, config=str(tmp_path / "nowhere"))


def test_key_mapping_renames_the_checkpoints_tensors(reference_qwen3_moe, tmp_path):
    """key_mapping (regex -> replacement, Transformers' semantics) applies to the checkpoint's names
    before they are matched to the model: a checkpoint saved under other names loads exactly."""
    from safetensors.torch import load_file, save_file

    ref = reference_qwen3_moe().eval()
    folder = save_per_expert_checkpoint(ref, tmp_path / "renamed")
    tensors = load_file(folder / "model.safetensors")
    renamed = {k.replace("model.", "backbone.", 1).replace(".norm.", ".final_norm."): v for k, v in tensors.items()}
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensors .*backbone.final_norm.weight"):
        moetune.AutoModelForCausalLM.from_pretrained(folder)
    key_mapping = {r"^backbone\.": "model.", r"\.final_norm\.": ".norm."}
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, key_mapping=key_mapping)
    # Exactly the weights of a load under the original names: the same implementation, bit-equal logits.
    expected = moetune.AutoModelForCausalLM.from_pretrained(save_per_expert_checkpoint(ref, tmp_path / "original"))
    ids = parity_batch(ref.config.vocab_size, padded=False)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"key_mapping pattern '\(' "):
        moetune.AutoModelForCausalLM.from_pretrained(folder, key_mapping={"(": "x"})


def test_save_records_the_models_dtype(reference_qwen3_moe, tmp_path):
    """A model cast after loading is saved with its dtype in config.json (as Transformers does), so
    both libraries load it back in that dtype."""
    model = moetune.AutoModelForCausalLM.from_pretrained(_save(reference_qwen3_moe(), tmp_path, "fused"))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_save_replaces_only_its_own_weight_files_and_writes_variants(reference_qwen3_moe, tmp_path):
    """save_pretrained removes what an earlier save of the same name left (shards of a longer save,
    their index), never other variants or other files; variant= writes Transformers' variant names,
    which Transformers and from_pretrained(variant=) load."""
    from safetensors.torch import save_file

    ref = reference_qwen3_moe().eval()
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(ref, tmp_path, "fused"))
    out = tmp_path / "out"
    ours.save_pretrained(out, max_shard_size="40KB")  # an earlier sharded save, to be replaced
    ref.save_pretrained(out, variant="bf16")
    save_file({"w": torch.zeros(2)}, str(out / "model_ema.safetensors"))
    ours.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir() if "safetensors" in p.name) == [
        "model.bf16.safetensors", "model.safetensors", "model_ema.safetensors"
    ]  # fmt: skip

    ours.save_pretrained(out, variant="v1", max_shard_size="40KB")
    shards = sorted(p.name for p in out.glob("model.v1-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model.v1-00001-of-{len(shards):05d}.safetensors"
    assert (out / "model.safetensors.index.v1.json").is_file() and (out / "model.safetensors").is_file()
    ids = parity_batch(ref.config.vocab_size, padded=False)[0]
    # Each library reloads exactly what it saved from: bit-equal logits to its own implementation.
    for library, original in ((transformers.AutoModelForCausalLM, ref), (moetune.AutoModelForCausalLM, ours)):
        reloaded = library.from_pretrained(out, variant="v1").eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids).logits, original.eval()(input_ids=ids).logits, rtol=0, atol=0)
    ours.save_pretrained(out, variant="v1")  # now one file: the shards and their index go
    assert not list(out.glob("model.v1-*")) and not (out / "model.safetensors.index.v1.json").exists()
    assert (out / "model.v1.safetensors").is_file() and (out / "model.bf16.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="variant='v2'"):
        moetune.AutoModelForCausalLM.from_pretrained(out, variant="v2")


def test_balanced_gate_routes_evenly(reference_qwen3_moe, tmp_path):
    folder = _save(reference_qwen3_moe(), tmp_path, "fused")
    model = moetune.AutoModelForCausalLM.from_pretrained(folder, balanced_gate=True)
    router = model.model.layers[0].mlp.gate
    routing = router(torch.randn(10, model.config.hidden_size))
    counts = torch.bincount(routing.experts_TK.flatten(), minlength=model.config.num_experts)
    assert counts.max() - counts.min() <= 1
    torch.testing.assert_close(routing.weights_TK, torch.full_like(routing.weights_TK, 0.5))


def test_aux_loss_under_generate(reference_qwen3_moe, tmp_path):
    ours = moetune.AutoModelForCausalLM.from_pretrained(_save(reference_qwen3_moe(), tmp_path, "fused"))
    ids, mask, _ = parity_batch(ours.config.vocab_size, padded=True)
    out = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 15)


def test_fp8_checkpoints_are_dequantized_while_loading(reference_qwen3_moe, tmp_path):
    """Qwen3's "-FP8" Hub format (128 x 128 block-scaled e4m3, per-expert tensors)."""
    from safetensors.torch import load_file

    from tests.conftest import quantize_fp8_checkpoint

    folder = save_per_expert_checkpoint(reference_qwen3_moe(hidden_size=160, moe_intermediate_size=144), tmp_path / "fp8")
    expected = quantize_fp8_checkpoint(folder)
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    for key, values in expected.items():
        torch.testing.assert_close(saved[key], values, rtol=0, atol=0, msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts_backend", ["auto", "quack"])
def test_bf16_on_gpu_is_as_close_to_fp32_as_transformers(reference_qwen3_moe, tmp_path, experts_backend):
    """bf16 on CUDA (grouped GEMM experts, or quack's): loss and gradients within 1e-2 of Transformers
    in fp32 holding the same weights, or no further than Transformers' own bf16 model."""
    ref = reference_qwen3_moe(hidden_size=64, moe_intermediate_size=32, intermediate_size=96)
    check_bf16_training_parity(_save(ref, tmp_path, "fused"), vocab=96, experts_backend=experts_backend)
