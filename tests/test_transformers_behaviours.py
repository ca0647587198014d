"""What users of Transformers' model classes do beyond a forward, and what moetune's classes must do
alike: attention dropout, a config that ties weights the checkpoint stores apart, a loss function of
their own, the aux-loss coefficient set on the model, the order of the parameters (optimizer states
saved from one load into the other), sequences shorter than Mamba-2's convolution, pickling, tuple
outputs in training, a Trainer checkpoint read back through ``load_state_dict``, batches with no
scored token, and labels outside the vocabulary. fp32 on CPU, against Transformers' classes."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file

import moetune
from tests.conftest import family_reference, rel_err

FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "nemotron_h"]


def _pair(family: str, tmp_path, **overrides):
    """Transformers' and moetune's model from one saved checkpoint, in train mode."""
    family_reference(family, **overrides).save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert type(ours).__module__.startswith("moetune.")
    return ref, ours


def _ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_gpt_oss_attention_dropout_stays_causal(tmp_path):
    """Dropout sends GPT-OSS's attention to Transformers' path, which needs its mask: a token must not
    see later ones, and the loss equals Transformers' at the same dropout seed."""
    ref, ours = _pair("gpt_oss", tmp_path, attention_dropout=0.1, output_router_logits=False)
    ids = _ids(ref.config.vocab_size, 1, 12)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % ref.config.vocab_size
    torch.manual_seed(0)
    first = ours(input_ids=ids, return_logits=True).logits[0, 0]
    torch.manual_seed(0)
    assert torch.equal(first, ours(input_ids=changed, return_logits=True).logits[0, 0])
    torch.manual_seed(0)
    expected = ref(input_ids=ids, labels=ids).loss
    torch.manual_seed(0)
    assert rel_err(ours(input_ids=ids, labels=ids).loss, expected) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_config_that_ties_weights_the_checkpoint_stores_apart_keeps_them_apart(family, tmp_path):
    """Transformers keeps a stored LM head that differs from the embedding (with a warning) instead of
    tying it away; equal ones are tied, as ``.bin`` files store a tied tensor twice."""
    family_reference(family, tie_word_embeddings=False).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")["lm_head.weight"]
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=True)
    assert torch.equal(ours.lm_head.weight, stored)
    assert ours.lm_head.weight is not ours.get_input_embeddings().weight
    ids = _ids(ref.config.vocab_size, 1, 8)
    with torch.no_grad():
        assert rel_err(ours.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits) < 1e-5

    tied = family_reference(family, tie_word_embeddings=False)
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.get_input_embeddings().weight)
    tied.save_pretrained(tmp_path / "equal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal halves: tied without a warning
        ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path / "equal", tie_word_embeddings=True)
    assert ours.lm_head.weight is ours.get_input_embeddings().weight


def test_a_loss_function_set_on_the_model_is_used_in_training(tmp_path):
    ref, ours = _pair("qwen3_moe", tmp_path, output_router_logits=False)

    def smoothed(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab_size).float(), labels[:, 1:].reshape(-1), label_smoothing=0.5
        )

    ids = _ids(ref.config.vocab_size, 2, 12)
    losses = []
    for model in (ref, ours):
        model.loss_function = smoothed
        losses.append(model(input_ids=ids, labels=ids).loss)
    assert rel_err(losses[1], losses[0]) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_aux_loss_coefficient_is_read_from_the_model_as_transformers_reads_it(family, tmp_path):
    ref, ours = _pair(family, tmp_path, output_router_logits=True)
    ids = _ids(ref.config.vocab_size, 2, 12)
    for model in (ref, ours):
        model.router_aux_loss_coef = 1.0
    assert rel_err(ours(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_come_in_transformers_order(family):
    """An optimizer's state is a list in ``parameters()`` order: saved from a Transformers run it must
    land on the same tensors in moetune's model. The same order also makes seeded inits draw alike."""
    ref = family_reference(family)
    ours = moetune.AutoModelForCausalLM.from_config(ref.config)
    assert [name for name, _ in ours.named_parameters()] == [name for name, _ in ref.named_parameters()]
    assert list(ours.state_dict()) == list(ref.state_dict())
    optimizer = torch.optim.AdamW(ref.parameters())
    ids = _ids(ref.config.vocab_size, 1, 8)
    ref(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    moved = torch.optim.AdamW(ours.parameters())
    moved.load_state_dict(optimizer.state_dict())
    ours(input_ids=ids, labels=ids).loss.backward()
    moved.step()  # shapes line up (a router's moments on an expert tensor would raise here)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_from_config_draws_transformers_initial_weights(family):
    ref = family_reference(family)
    torch.manual_seed(0)
    theirs = type(ref)(ref.config).state_dict()
    torch.manual_seed(0)
    ours = moetune.AutoModelForCausalLM.from_config(ref.config).state_dict()
    assert [name for name in theirs if not torch.equal(theirs[name], ours[name])] == []


@pytest.mark.parametrize("length", [1, 2, 3])
def test_nemotron_h_takes_sequences_shorter_than_its_convolution(length, tmp_path):
    ref, ours = _pair("nemotron_h", tmp_path)
    assert ref.config.conv_kernel > length
    ids = _ids(ref.config.vocab_size, 2, length)
    expected = ref(input_ids=ids).logits
    assert rel_err(ours(input_ids=ids, return_logits=True).logits, expected) < 1e-5
    assert rel_err(ours.eval()(input_ids=ids, use_cache=False).logits, expected) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_models_pickle_whole(family):
    """``torch.save(model)`` and ``copy.deepcopy`` pickle the modules (a lambda held by one fails)."""
    model = moetune.AutoModelForCausalLM.from_config(family_reference(family).config)
    ids = _ids(model.config.vocab_size, 1, 8)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)  # the test's own bytes
    assert rel_err(again.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits) < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("router_logits", [False, True])
def test_tuple_outputs_in_training_keep_transformers_positions(family, router_logits, tmp_path):
    ref, ours = _pair(family, tmp_path, output_router_logits=router_logits)
    ids = _ids(ref.config.vocab_size, 2, 12)

    def layout(model):
        torch.manual_seed(0)
        out = model(input_ids=ids, labels=ids, return_dict=False)
        return [(type(x).__name__, tuple(x.shape) if torch.is_tensor(x) else None) for x in out], out

    (theirs, ref_out), (ours_layout, our_out) = layout(ref), layout(ours)
    # Transformers before 5.2x returns no router logits from DeepSeek-V3 / Nemotron-H (its output class
    # has no such field); moetune appends them last, where they displace nothing.
    declares_router_logits = "router_logits" in type(ref(input_ids=ids, labels=ids)).__dataclass_fields__
    extra = [] if declares_router_logits else [("tuple", None)] * router_logits
    assert ours_layout == theirs + extra
    assert rel_err(our_out[0], ref_out[0]) < 1e-5
    logits_at = 2 if router_logits and family in ("qwen3_moe", "gpt_oss") else 1  # after the aux loss
    assert rel_err(our_out[logits_at], ref_out[logits_at]) < 1e-5


def test_a_nemotron_h_trainer_checkpoint_loads_back_through_load_state_dict(tmp_path):
    """The Trainer's resume and ``load_best_model_at_end`` read a checkpoint's safetensors (the Hub's
    ``backbone.`` names) with ``model.load_state_dict(state_dict, strict=False)``."""
    model = moetune.AutoModelForCausalLM.from_config(family_reference("nemotron_h").config)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    assert any(key.startswith("backbone.") for key in state)
    fresh = moetune.AutoModelForCausalLM.from_config(model.config)
    result = fresh.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_a_batch_with_no_scored_token_leaves_the_gradients_finite(family, tmp_path):
    """Transformers' loss of a batch whose labels are all -100 is NaN (0 / 0) with zero gradients; a
    NaN gradient would destroy every weight at the optimizer step."""
    ref, ours = _pair(family, tmp_path, output_router_logits=False)
    ids = _ids(ref.config.vocab_size, 2, 8)
    labels = torch.full_like(ids, -100)
    for model in (ref, ours):
        loss = model(input_ids=ids, labels=labels).loss
        assert torch.isnan(loss)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert all(p.grad.abs().max() == 0 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("bad", [-1, 96, 1000])
def test_labels_outside_the_vocabulary_are_an_error_naming_them(bad, tmp_path):
    _, ours = _pair("qwen3_moe", tmp_path, output_router_logits=False)
    ids = _ids(ours.config.vocab_size, 2, 8)
    labels = ids.clone()
    labels[0, 3] = bad
    with pytest.raises(ValueError, match=rf"labels: .*\[0, {ours.config.vocab_size}\).*-100.*\[{bad}\]"):
        ours(input_ids=ids, labels=labels)


@pytest.mark.gpu
def test_labels_outside_the_vocabulary_on_cuda_stop_the_next_forward(tmp_path):
    """On CUDA the check is read when the next loss starts (no host synchronisation per step)."""
    family_reference("qwen3_moe", output_router_logits=False).save_pretrained(tmp_path)
    ours = moetune.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda").train()
    ids = _ids(ours.config.vocab_size, 2, 8).cuda()
    labels = ids.clone()
    labels[1, 2] = -1
    ours(input_ids=ids, labels=labels).loss.backward()
    with pytest.raises(ValueError, match="previous batch's labels"):
        ours(input_ids=ids, labels=ids)
    ours(input_ids=ids, labels=ids).loss.backward()  # reported once; good labels train on
