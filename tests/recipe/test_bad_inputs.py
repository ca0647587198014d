"""Bad input to `moetune finetune` ends in an error that names the field, file or line, raised before
the data is tokenised or the model built."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import transformers
from transformers import AutoTokenizer

from moetune.cli import main
from moetune.recipe import train
from moetune.recipe.config import DEFAULT_ASSETS
from moetune.recipe.data_sources import ReadStats, read_rows
from moetune.recipe.train import finetune

TOKENIZER_SIZE = len(AutoTokenizer.from_pretrained(DEFAULT_ASSETS / "tokenizer"))


def _no_data_work(monkeypatch):
    """Refusals come before the data is read and tokenised (and so before the model is built)."""
    monkeypatch.setattr(train, "prepare_data", lambda *a, **k: pytest.fail("the data was prepared"))


def _model_dir(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _shipped_config() -> dict:
    return json.loads((DEFAULT_ASSETS / "model" / "config.json").read_text())


def test_an_encoder_config_is_refused_naming_the_model_type_and_field(tiny_job, tmp_path, monkeypatch):
    """BERT's causal-LM class attends both ways unless is_decoder is true: it would train and export
    as if causal while seeing the tokens it predicts."""
    bert = transformers.BertConfig(vocab_size=TOKENIZER_SIZE, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32).to_dict()
    _no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=r"not a causal LM: model_type 'bert': BertLMHeadModel attends in both "
                                         r"directions unless the config field is_decoder is true"):
        finetune(tiny_job(model__config_path=_model_dir(tmp_path, bert)))
    t5 = transformers.T5Config(vocab_size=TOKENIZER_SIZE, d_model=32, num_layers=1, num_heads=2, d_ff=32).to_dict()
    with pytest.raises(ValueError, match=r"model_type 't5' \(T5Config\) has no causal-LM class in Transformers"):
        finetune(tiny_job(model__config_path=_model_dir(tmp_path, t5)))


def test_an_encoder_set_up_as_a_decoder_is_accepted():
    from moetune.recipe.model_loading import check_model_for_job

    bert = transformers.BertConfig(vocab_size=TOKENIZER_SIZE, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, is_decoder=True)
    assert check_model_for_job(bert, packing=False, cuda_graph=False, tokenizer_size=TOKENIZER_SIZE) is False


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_naming_both(tiny_job, tmp_path, monkeypatch):
    small = {**_shipped_config(), "vocab_size": TOKENIZER_SIZE - 10}
    _no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=rf"model.tokenizer_path: the tokenizer has {TOKENIZER_SIZE} tokens but the model's "
                                         rf"input embedding has {TOKENIZER_SIZE - 10} rows"):
        finetune(tiny_job(model__config_path=_model_dir(tmp_path, small)))


def test_a_truncated_weight_file_is_named_before_any_data_work(tiny_job, tmp_path, monkeypatch):
    """For every architecture (Transformers' loader, for the ones moetune does not implement, names no file)."""
    from moetune import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(DEFAULT_ASSETS / "model")).save_pretrained(
        tmp_path / "pretrained")
    weights = tmp_path / "pretrained" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    _no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=rf"model.pretrained_path: {weights} is truncated: {len(data) // 3} of the "
                                         rf"{len(data)} bytes its header describes"):
        finetune(tiny_job(model__pretrained_path=tmp_path / "pretrained"))


def test_a_config_json_that_is_not_json_names_the_file_line_and_column(tiny_job, tmp_path, monkeypatch):
    folder = _model_dir(tmp_path, {})
    (folder / "config.json").write_text('{\n  "model_type": "qwen3_moe",\n  "hidden_size": 128\n  "vocab_size": 9\n}')
    _no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=r"model.config_path: .*config.json is not valid JSON: Expecting ',' delimiter "
                                         r"\(line 4, column 3\)"):
        finetune(tiny_job(model__config_path=folder))


def test_a_row_that_is_not_utf8_is_skipped_and_counted_or_named(tiny_job, tmp_path):
    rows = (tmp_path / "train.jsonl").read_bytes().splitlines(keepends=True)
    rows[4] = rows[4].replace(b"+", b"\xff+", 1)  # line 5: a Latin-1 byte in a UTF-8 file
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b"".join(rows))
    stats = ReadStats()
    read = read_rows(str(bad), field_name="data.train_path", split="train", on_bad_row="skip", stats=stats)
    assert len(read) == len(rows) - 1 and stats.bad_rows == 1
    column = rows[4].index(b"\xff") + 1
    assert stats.examples == [f"{bad}:5: not UTF-8 text (byte 0xff at column {column})"]
    assert finetune(tiny_job(data__train_path=bad, training__steps=2)).step == 2  # skip: the run goes on
    with pytest.raises(ValueError, match=rf"{bad}:5: not UTF-8 text \(byte 0xff .*set data.on_bad_row: skip"):
        finetune(tiny_job(data__train_path=bad, data__on_bad_row="fail"))


def test_a_max_length_that_cuts_every_answer_says_how_many_and_why(tiny_job, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=r"no usable samples in .*train.jsonl \(0 malformed rows skipped; 240 samples "
                                         r"truncated to data.max_length 8 tokens; 240 of them dropped because truncation "
                                         r"cut away every answer token \(their answers start at token (\d+) or later\); "
                                         r"0 samples with an empty answer dropped\)\. To keep them: raise data.max_length "
                                         r"to at least \1 \(to keep an answer token\) or to \d+ \(the longest sample, whole\)"):
        finetune(tiny_job(data__max_length=8))


def test_an_output_dir_that_is_a_file_or_cannot_be_created_is_refused_at_the_start(tiny_job, tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    _no_data_work(monkeypatch)
    with pytest.raises(ValueError, match=rf"training.output_dir: {a_file} exists and is not a folder"):
        finetune(tiny_job(a_file))
    with pytest.raises(ValueError, match=rf"training.output_dir: {a_file / 'out'} cannot be created \(Not a directory\)"):
        finetune(tiny_job(a_file / "out"))
    assert a_file.read_text() == "not a folder"


def test_a_read_only_output_dir_is_refused_at_the_start(tiny_job, monkeypatch):
    """Checked in a child process, as an unprivileged user where the tests run as root (root writes
    into read-only folders)."""
    folder = Path(tempfile.mkdtemp())
    os.chmod(folder, 0o555)
    config = tiny_job(folder / "out")
    (folder / "out").mkdir(mode=0o555)
    _no_data_work(monkeypatch)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the error through the pipe, never return into pytest
        message = "no error"
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            finetune(config)
        except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
            message = f"{type(err).__name__}: {err}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    shutil.rmtree(folder, ignore_errors=True)
    assert message.startswith(f"ValueError: training.output_dir: cannot write into {folder / 'out'} (Permission denied")


@pytest.mark.parametrize("value", ["-1", "0"])
def test_nproc_per_node_below_one_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--nproc-per-node", value])
    assert exit_info.value.code == 2
    assert f"--nproc-per-node: must be >= 1 (processes to start on this node), got {value}" in capsys.readouterr().err
