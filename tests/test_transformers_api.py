"""Transformers' user-facing API on moetune's four families against Transformers' model holding the
same weights (tiny fp32 configs, CPU): the forward's signature and tuple outputs, forward flags,
generation (left-padded, with and without a KV cache), ``gradient_checkpointing_enable``."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

import moetune
from tests import test_deepseek_v3_parity, test_gpt_oss_parity, test_nemotron_h_parity
from tests.conftest import family_reference, parity_batch, rel_err, save_with_transformers, tiny_qwen3_moe_config

TOL = 1e-5
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h"]


def _pair(family: str, tmp_path, **overrides):
    """(Transformers' model, moetune's) with the same weights, both as ``from_pretrained`` loads them."""
    folder = save_with_transformers(family_reference(family, **overrides), tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ours = moetune.AutoModelForCausalLM.from_pretrained(folder)
    assert type(ours).__module__.startswith("moetune.")
    return ref, ours


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_takes_transformers_arguments_in_transformers_order(family):
    """``model(ids, mask, position_ids)`` means what it means to Transformers (moetune's forward once
    took the third for labels), and Trainer, which drops the dataset columns the forward does not
    name, keeps ``position_ids`` and ``inputs_embeds``."""
    hf_cls = getattr(transformers, _reference_class_name(family))
    ours_cls = type(moetune.AutoModelForCausalLM.from_config(_tiny_config(family)))
    theirs = [n for n in inspect.signature(hf_cls.forward).parameters if n not in ("self", "kwargs")]
    ours = [n for n in inspect.signature(ours_cls.forward).parameters if n != "self"]
    # The KV cache is `cache` from Transformers 5.24 on, `past_key_values` before (moetune names it `cache`).
    theirs = ["cache" if n == "past_key_values" else n for n in theirs]
    assert [n for n in ours if n in theirs] == theirs
    assert ours[: theirs.index("labels") + 1] == theirs[: theirs.index("labels") + 1]


def _reference_class_name(family: str) -> str:
    return {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
            "gpt_oss": "GptOssForCausalLM", "nemotron_h": "NemotronHForCausalLM"}[family]  # fmt: skip


def _tiny_config(family: str):
    if family == "qwen3_moe":
        return tiny_qwen3_moe_config()
    module = {"deepseek_v3": test_deepseek_v3_parity, "gpt_oss": test_gpt_oss_parity, "nemotron_h": test_nemotron_h_parity}
    return getattr(module[family], f"tiny_{family}_config")()


def test_positional_position_ids_are_positions(tmp_path):
    ref, ours = _pair("qwen3_moe", tmp_path)
    ref.eval()
    ours.eval()
    ids, mask, _ = parity_batch(ref.config.vocab_size, padded=False)
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + 5
    got, expected = ours(ids, mask, positions), ref(ids, mask, positions)
    assert got.loss is None and rel_err(got.logits, expected.logits) < TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_return_dict_false_gives_transformers_tuples(family, tmp_path):
    """``return_dict=False`` on the backbone (also with router logits, which once failed on the
    tuple) and a config's ``return_dict=False`` give tuples, in Transformers' order."""
    ref, ours = _pair(family, tmp_path, output_router_logits=True)
    ref.eval()
    ours.eval()
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=True)
    for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
        got = ours.model(**inputs, return_dict=False)
        expected = ref.model(**inputs, return_dict=False)
        # Transformers' Nemotron-H backbone returns router logits only from 5.2x on (5.10: none);
        # moetune's always does when asked, last as in later Transformers.
        ref_has_router_logits = "router_logits" in ref.model(**inputs)
        assert isinstance(got, tuple) and len(got) == len(expected) + (not ref_has_router_logits)
        assert rel_err(got[0], expected[0]) < TOL
        assert len(got[-1]) == 2 and (not ref_has_router_logits or len(expected[-1]) == 2)  # router logits
    assert isinstance(ours.train().model(input_ids=ids, return_dict=False), tuple)  # the plain causal path
    # A config's return_dict=False (Transformers 5.25's own CausalLM fails on its backbone's tuple).
    ours.config.return_dict = False
    for mode in ("train", "eval"):
        getattr(ours, mode)()
        got = ours(input_ids=ids, attention_mask=mask, labels=labels)
        assert isinstance(got, tuple) and rel_err(got[0], ref(input_ids=ids, attention_mask=mask, labels=labels).loss) < TOL
    assert isinstance(ours(input_ids=ids, return_dict=True), transformers.modeling_outputs.ModelOutput)


def test_shift_labels_alone_train_on_the_fused_loss(tmp_path):
    """Pre-shifted labels (``shift_labels``, as context parallelism passes them) in training take the
    fused LM-head loss like ``labels`` do: no [tokens, vocab] logits, the same loss."""
    _, ours = _pair("qwen3_moe", tmp_path)
    ours.train()
    ids, mask, labels = parity_batch(ours.config.vocab_size, padded=True)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    got = ours(input_ids=ids, attention_mask=mask, shift_labels=shifted)
    assert got.logits is None
    assert rel_err(got.loss, ours(input_ids=ids, attention_mask=mask, labels=labels).loss) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_flags_match_transformers(family, tmp_path):
    """output_hidden_states, output_router_logits, inputs_embeds, explicit position_ids,
    logits_to_keep and num_items_in_batch, in training (padded batch) and evaluation."""
    ref, ours = _pair(family, tmp_path, output_router_logits=True)
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=True)
    keep = mask.bool()
    for mode in ("train", "eval"):
        getattr(ref, mode)()
        getattr(ours, mode)()
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_logits=True)
        expected = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert len(got.hidden_states) == len(expected.hidden_states) == ref.config.num_hidden_layers + 1
        for a, b in zip(got.hidden_states, expected.hidden_states):
            assert rel_err(a[keep], b[keep]) < TOL
        # Transformers' DeepSeek-V3 and Nemotron-H outputs carry router logits only from 5.2x on
        # (5.10's CausalLMOutputWithPast has no such field).
        expected_router_logits = getattr(expected, "router_logits", None)
        assert expected_router_logits is None or len(got.router_logits) == len(expected_router_logits)
        for a, b in zip(got.router_logits, expected_router_logits or ()):
            assert rel_err(a, b.reshape(a.shape)) < TOL
        embeds = ref.get_input_embeddings()(ids)
        got = ours(inputs_embeds=embeds, attention_mask=mask, labels=labels, return_logits=True)
        expected = ref(inputs_embeds=embeds, attention_mask=mask, labels=labels)
        assert rel_err(got.logits[keep], expected.logits[keep]) < TOL and rel_err(got.loss, expected.loss) < TOL
        positions = torch.arange(ids.shape[1]).expand(2, -1) + 3
        got = ours(input_ids=ids, position_ids=positions, labels=labels, return_logits=True)
        expected = ref(input_ids=ids, position_ids=positions, labels=labels)
        assert rel_err(got.logits, expected.logits) < TOL and rel_err(got.loss, expected.loss) < TOL
        for kept in (1, torch.tensor([0, 5, 11])):
            assert rel_err(ours(input_ids=ids, logits_to_keep=kept).logits, ref(input_ids=ids, logits_to_keep=kept).logits) < TOL
        count = torch.tensor(40)
        got = ours(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count)
        assert rel_err(got.loss, ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_generation_with_and_without_cache(family, tmp_path):
    # No router logits: Transformers' own aux loss fails under generate with a padded mask.
    ref, ours = _pair(family, tmp_path, output_router_logits=False)
    ref.eval()
    ours.eval()
    ids, mask, _ = parity_batch(ref.config.vocab_size, padded=True)
    ids, mask = ids[:, :8], mask[:, :8]
    for use_cache in (True, False):
        settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, use_cache=use_cache)
        got = ours.generate(input_ids=ids, attention_mask=mask, **settings)
        assert got.shape == (2, 13)
        assert torch.equal(got, ref.generate(input_ids=ids, attention_mask=mask, **settings)), use_cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")  # 5.2x's rename
def test_gradient_checkpointing_enable_and_disable(family, tmp_path):
    """Transformers' ``gradient_checkpointing_enable()`` (non-reentrant, its default) on moetune's
    model: the loss and every gradient equal Transformers' without checkpointing, padded or not."""
    ref, ours = _pair(family, tmp_path)
    ref.train()
    ours.train()
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=True)

    def loss_and_grads(model, **inputs):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels, **inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    for inputs in ({}, {"attention_mask": mask}):
        expected_loss, expected = loss_and_grads(ref, **inputs)
        ours.gradient_checkpointing_enable()
        assert ours.is_gradient_checkpointing
        loss, grads = loss_and_grads(ours, **inputs)
        ours.gradient_checkpointing_disable()
        assert not ours.is_gradient_checkpointing
        assert rel_err(loss, expected_loss) < TOL
        for name, grad in expected.items():
            assert rel_err(grads[name], grad) < 1e-5 or (grads[name] - grad).abs().max() < 1e-9, name


PEFT_TARGETS = {
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj"],  # PEFT refuses Mamba's out_proj / conv1d
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on Transformers 5.2x
def test_peft_adapter_trained_on_moetune_loads_onto_transformers(family, tmp_path):
    """``peft.get_peft_model`` on moetune's model (attention projections; moetune's own attention
    forwards call them): a training step gives Transformers + PEFT's loss and adapter gradients, and
    the adapter it saves, loaded by PEFT onto plain Transformers, gives the same logits."""
    peft = pytest.importorskip("peft")
    ref, ours = _pair(family, tmp_path)
    config = dict(r=4, lora_alpha=8, target_modules=PEFT_TARGETS[family], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(ours, peft.LoraConfig(**config))
    expected_model = peft.get_peft_model(ref, peft.LoraConfig(**config))
    expected_model.load_state_dict(model.state_dict())
    ids, mask, labels = parity_batch(ref.config.vocab_size, padded=True)
    keep = mask.bool()
    for m in (model, expected_model):
        m.train()
    losses = [m(input_ids=ids, attention_mask=mask, labels=labels).loss for m in (model, expected_model)]
    assert rel_err(losses[0], losses[1]) < TOL
    for loss in losses:
        loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (model, expected_model)]
    assert grads[0].keys() == grads[1].keys() and all(".lora_" in n for n in grads[0])
    for name, grad in grads[1].items():
        assert rel_err(grads[0][name], grad) < TOL, name
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param -= 0.5 * param.grad
    model.save_pretrained(tmp_path / "adapter")

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, attention_mask=mask).logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(plain).__module__.startswith("transformers.")
    with torch.no_grad():
        base = plain(input_ids=ids, attention_mask=mask).logits
        loaded = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter").eval()
        assert rel_err(base[keep], adapted[keep]) > 1e-2  # the adapters matter, so a dropped one would show
        assert rel_err(loaded(input_ids=ids, attention_mask=mask).logits[keep], adapted[keep]) < TOL


def test_generate_keeps_the_experts_backend_on_gpus(monkeypatch):
    """Transformers' generate() switches grouped_mm experts to its batched_mm kernel while decoding on
    a GPU; moetune's experts keep their backend, without the warning a user's own switch gets."""
    import warnings

    model = moetune.AutoModelForCausalLM.from_config(tiny_qwen3_moe_config())
    before = model.get_experts_implementation()
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with model._optimize_model_for_decode():
            assert model.get_experts_implementation() == before
