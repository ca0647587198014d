"""Data: sources, chat formatting with answer-only labels, bad rows, truncation, packing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from moetune import AutoModelForCausalLM
from moetune.recipe.config import DEFAULT_ASSETS
from moetune.recipe.data_sources import ReadStats, read_rows
from moetune.recipe.formatting import IGNORE_INDEX, Sample, tokenize_rows
from moetune.recipe.packing import BatchStream, collate, pack, split_validation

from recipe_helpers import shipped_rows, write_jsonl

# the recipe extra (pip install -e ".[recipe]"); GPU machines may lack it, and this module holds no GPU test
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_ASSETS / "tokenizer")


def tokenize(rows, tokenizer, *, max_length=64, on_bad_row="skip", stats=None):
    return tokenize_rows(rows, tokenizer, messages_column="messages", prompt_column="prompt",
                         answer_column="answer", max_length=max_length, on_bad_row=on_bad_row,
                         stats=stats or ReadStats())


def read(path, *, on_bad_row="skip", stats=None):
    return read_rows(str(path), field_name="data.train_path", split="train", on_bad_row=on_bad_row,
                     stats=stats or ReadStats())


def test_jsonl_parquet_and_datasets_dir_give_the_same_rows(tmp_path):
    rows = [{"prompt": "1+2", "answer": "3"}, {"prompt": "4+5", "answer": "9"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in ["d.jsonl", "d.parquet", "saved", "saved_dict"]:
        assert read(tmp_path / source) == rows, source


def test_missing_file_names_the_field_and_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"data.train_path: file .*nope.jsonl does not exist"):
        read(tmp_path / "nope.jsonl")


def test_malformed_rows_are_skipped_and_counted_or_fail(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    path.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"text": "no columns"}) + "\n")
    stats = ReadStats()
    samples = tokenize(read(path, stats=stats), tokenizer, stats=stats)
    assert len(samples) == 1 and stats.bad_rows == 2
    assert "bad.jsonl:2: not valid JSON" in stats.examples[0]
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON.*on_bad_row"):
        read(path, on_bad_row="fail")


def test_labels_cover_exactly_the_answers(tokenizer):
    rows = [{"prompt": "12+30", "answer": "42"},
            {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                          {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}]
    first, second = tokenize(rows, tokenizer)
    answer = [t for t, label in zip(first.input_ids, first.labels) if label != IGNORE_INDEX]
    assert tokenizer.decode(answer) == "42<|im_end|>\n"
    answers = tokenizer.decode([t for t, label in zip(second.input_ids, second.labels) if label != IGNORE_INDEX])
    assert answers == "2<|im_end|>\n4<|im_end|>\n"  # every assistant turn, nothing else


def test_long_samples_are_truncated_and_counted(tokenizer):
    stats = ReadStats()
    rows = [{"prompt": "9" * 40, "answer": "1"}, {"prompt": "1+1", "answer": "2"}]
    samples = tokenize(rows, tokenizer, max_length=20, stats=stats)
    assert [len(s.input_ids) for s in samples] == [14]  # the long one lost its answer: dropped
    assert stats.truncated == 1 and stats.answers_cut == 1 and stats.empty == 0


def test_packed_loss_equals_unpacked_loss(tokenizer):
    """Per-document positions + the block-diagonal mask: a packed row scores each sample exactly
    as if it were alone (the attention never crosses a boundary)."""
    samples = tokenize(shipped_rows("train.jsonl", 12), tokenizer)
    config = AutoConfig.from_pretrained(DEFAULT_ASSETS / "model")
    config.initializer_range = 0.3  # large weights: attention across a boundary would show plainly
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    rows = pack(samples, max_length=64)
    assert len(rows) < len(samples) and all(len(r) > 1 for r in rows[:-1])
    packed = collate(rows, pad_id=tokenizer.pad_token_id, max_length=64, packed=True)
    with torch.no_grad():
        packed_sum = model(**packed.model_inputs(torch.device("cpu")), num_items_in_batch=1).loss
        alone_sum = sum(model(**collate([[s]], pad_id=0, max_length=64, packed=False)
                              .model_inputs(torch.device("cpu")), num_items_in_batch=1).loss for s in samples)
    assert packed.num_label_tokens == sum(sum(label != IGNORE_INDEX for label in s.labels[1:]) for s in samples)
    torch.testing.assert_close(packed_sum, alone_sum, rtol=1e-5, atol=1e-4)
    cpu = torch.device("cpu")
    with torch.no_grad():  # and the logits of every sample of the first row, token by token
        packed_logits = model(**packed.model_inputs(cpu)).logits[0]
        start = 0
        for sample in rows[0]:
            alone = model(**collate([[sample]], pad_id=0, max_length=64, packed=False).model_inputs(cpu)).logits[0]
            torch.testing.assert_close(packed_logits[start:start + len(sample.input_ids)], alone, rtol=1e-4, atol=1e-4)
            start += len(sample.input_ids)
    # Positions restart per document.
    assert packed.position_ids_BT[0, : len(rows[0][0].input_ids) + 1].tolist()[-1] == 0


def _samples_of_lengths(lengths):
    # input_ids [i, i, ...]: each sample is recognisable by its first token
    return [Sample(input_ids=[i] * n, labels=[i] * n) for i, n in enumerate(lengths)]


def _best_fit_reference(lengths, max_length):
    """Best-fit decreasing by brute force: each sample, longest first, into the row with the least
    room left that holds it (rows tied on room are interchangeable); returns the rows' fills."""
    fills = []
    for n in sorted(lengths, reverse=True):
        fitting = [r for r, used in enumerate(fills) if max_length - used >= n]
        if fitting:
            best = min(fitting, key=lambda r: max_length - fills[r])
            fills[best] += n
        else:
            fills.append(n)
    return sorted(fills)


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_packing_matches_brute_force_and_keeps_every_sample_once(seed):
    import random

    rng = random.Random(seed)
    max_length = rng.choice([64, 100, 4096])
    lengths = [rng.randint(1, max_length) for _ in range(rng.randint(1, 300))]
    rows = pack(_samples_of_lengths(lengths), max_length=max_length, strategy="best_fit")
    fills = sorted(sum(len(s.input_ids) for s in row) for row in rows)
    # The same row fills as brute-force best fit (tied rows are interchangeable: equal room left).
    assert fills == _best_fit_reference(lengths, max_length)
    assert all(fill <= max_length for fill in fills)
    assert sorted(s.input_ids[0] for row in rows for s in row) == list(range(len(lengths)))


def test_best_fit_packing_pads_far_less_than_in_order():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(200, 3000) for _ in range(2000)]  # benchmarks/recipe_probe.py's spread
    samples = _samples_of_lengths(lengths)
    efficiency = {strategy: sum(lengths) / (4096 * len(pack(samples, max_length=4096, strategy=strategy)))
                  for strategy in ("best_fit", "in_order")}
    assert efficiency["best_fit"] > 0.99 and efficiency["in_order"] < 0.8, efficiency


def test_in_order_packing_keeps_the_order_and_unknown_strategies_are_named():
    rows = pack(_samples_of_lengths([30, 30, 10, 40, 64]), max_length=64, strategy="in_order")
    assert [[s.input_ids[0] for s in row] for row in rows] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="data.packing_strategy"):
        pack(_samples_of_lengths([3]), max_length=8, strategy="first_fit")


@pytest.mark.parametrize("strategy", ["best_fit", "in_order"])
def test_batch_stream_rows_hold_each_sample_once_per_epoch(tokenizer, strategy):
    samples = tokenize(shipped_rows("train.jsonl", 60), tokenizer)
    stream = BatchStream(samples, micro_batch_size=1, max_length=64, packed=True, pad_id=0, seed=3,
                         packing_strategy=strategy)
    rows = stream._batches_of_epoch(0)
    flat = [id(s) for batch in rows for row in batch for s in row]
    assert len(flat) == len(set(flat)) and set(flat) <= {id(s) for s in samples}
    # Only the last incomplete global batch may be dropped; with micro_batch_size 1 none is.
    assert len(flat) == len(samples)


def _collate_reference(rows, *, pad_id, max_length, packed):
    """collate's rules spelled out on lists: samples concatenated, no label on each first token,
    positions restarting per sample and over the padding run, padding to the row width."""
    width = max_length if packed else max(len(r[0].input_ids) for r in rows)
    ids, labels, positions, real = [], [], [], []
    for row in rows:
        row_ids = [t for s in row for t in s.input_ids]
        row_labels = [label for s in row for label in [IGNORE_INDEX, *s.labels[1:]]]
        row_pos = [p for s in row for p in range(len(s.input_ids))]
        pad = width - len(row_ids)
        ids.append(row_ids + [pad_id] * pad)
        labels.append(row_labels + [IGNORE_INDEX] * pad)
        positions.append(row_pos + list(range(pad)))
        real.append([1] * len(row_ids) + [0] * pad)
    return torch.tensor(ids), torch.tensor(labels), torch.tensor(positions), torch.tensor(real)


@pytest.mark.parametrize("packed", [True, False])
def test_collate_matches_the_rules_on_lists(packed):
    import random

    rng = random.Random(1)
    samples = [Sample(input_ids=[rng.randint(0, 300) for _ in range(n)],
                      labels=[rng.choice([IGNORE_INDEX, rng.randint(0, 300)]) for _ in range(n)])
               for n in (rng.randint(1, 40) for _ in range(60))]  # fmt: skip
    rows = pack(samples, max_length=64) if packed else [[s] for s in samples]
    for i in range(0, len(rows) - 2, 3):
        batch = collate(rows[i:i + 3], pad_id=7, max_length=64, packed=packed)
        ids, labels, positions, real = _collate_reference(rows[i:i + 3], pad_id=7, max_length=64, packed=packed)
        assert torch.equal(batch.input_ids_BT, ids) and torch.equal(batch.labels_BT, labels)
        assert torch.equal(batch.position_ids_BT, positions) and torch.equal(batch.real_BT, real.bool())
        assert batch.attention_mask_BT is None if packed else torch.equal(batch.attention_mask_BT, real)
        assert batch.input_ids_BT.dtype == batch.labels_BT.dtype == torch.int64
        assert batch.num_tokens == int(real.sum()) and batch.num_label_tokens == int((labels != IGNORE_INDEX).sum())


def test_pad_to_multiple_of_bounds_the_widths_and_leaves_the_loss_alone(tokenizer):
    """Unpacked micro-batches padded to a multiple of 16 tokens: widths only from {16, 32, ...}, the
    extra columns are padding (no label, masked out), and the loss and the real tokens' logits are
    those of the batch padded to its longest sample."""
    samples = tokenize(shipped_rows("train.jsonl", 12), tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_ASSETS / "model")).eval()
    cpu = torch.device("cpu")
    for i in range(0, 12, 4):
        rows = [[s] for s in samples[i:i + 4]]
        longest = collate(rows, pad_id=tokenizer.pad_token_id, max_length=64, packed=False)
        rounded = collate(rows, pad_id=tokenizer.pad_token_id, max_length=64, packed=False, pad_to_multiple_of=16)
        width = longest.input_ids_BT.shape[1]
        assert rounded.input_ids_BT.shape[1] == -(-width // 16) * 16 > width - 16
        assert (rounded.num_tokens, rounded.num_label_tokens) == (longest.num_tokens, longest.num_label_tokens)
        assert torch.equal(rounded.input_ids_BT[:, :width], longest.input_ids_BT)
        assert not rounded.real_BT[:, width:].any() and (rounded.labels_BT[:, width:] == IGNORE_INDEX).all()
        with torch.no_grad():
            a, b = (model(**batch.model_inputs(cpu)) for batch in (longest, rounded))
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.logits[:, :width][longest.real_BT], a.logits[longest.real_BT], rtol=1e-5, atol=1e-5)
    stream = BatchStream(samples, micro_batch_size=3, max_length=64, packed=False, pad_id=0, seed=0, pad_to_multiple_of=16)
    assert {next(stream).input_ids_BT.shape[1] % 16 for _ in range(6)} == {0}


def test_batch_stream_is_deterministic_and_resumable(tokenizer):
    samples = tokenize(shipped_rows("train.jsonl", 60), tokenizer)

    def stream():
        return BatchStream(samples, micro_batch_size=2, max_length=64, packed=True, pad_id=0, seed=3)

    a = stream()
    first = [next(a).input_ids_BT for _ in range(7)]  # crosses an epoch boundary
    b = stream()
    for _ in range(4):
        next(b)
    c = stream()
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(first[4:], [next(c).input_ids_BT for _ in range(3)]))
    assert all(torch.equal(x, y) for x, y in zip(first, [next(stream()).input_ids_BT]))


def test_ranks_get_disjoint_micro_batches(tokenizer):
    samples = tokenize(shipped_rows("train.jsonl", 60), tokenizer)
    seen = [next(BatchStream(samples, micro_batch_size=2, max_length=64, packed=True, pad_id=0, seed=3,
                             rank=r, world_size=2)).input_ids_BT for r in range(2)]
    assert not torch.equal(seen[0], seen[1])


def test_validation_split_is_seeded_and_disjoint(tokenizer):
    samples = tokenize(shipped_rows("train.jsonl", 50), tokenizer)
    train, val = split_validation(samples, fraction=0.2, seed=1)
    again, val_again = split_validation(samples, fraction=0.2, seed=1)
    assert len(val) == 10 and len(train) == 40 and val == val_again
    assert not {id(s) for s in train} & {id(s) for s in val}


def test_validation_batches_are_as_many_on_every_rank(tokenizer):
    from moetune.recipe.packing import fixed_batches

    samples = tokenize(shipped_rows("train.jsonl", 3), tokenizer)
    per_rank = [fixed_batches(samples, micro_batch_size=1, max_length=64, packed=True, pad_id=0, rank=r,
                              world_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 1  # one packed row: rank 1 gets a label-free one
    assert per_rank[0][0].num_label_tokens > 0 and per_rank[1][0].num_label_tokens == 0


_READ_FROM_CACHE = """
import json, os, sys
import datasets
from datasets.packaged_modules.json.json import Json
from moetune.recipe.data_sources import ReadStats, read_rows

# A dataset in the local cache as a Hub download leaves it: <cache>/<owner>___<name>/<config>/<version>/<commit>/.
Json(dataset_name="sft-data", data_files={"train": sys.argv[1]}).download_and_prepare()
root = datasets.config.HF_DATASETS_CACHE
built = os.path.join(root, "sft-data")
config_dir = os.listdir(built)[0]
os.makedirs(os.path.join(root, "someone___sft-data", "default", "0.0.0"))
os.rename(os.path.join(built, config_dir, "0.0.0"), os.path.join(root, "someone___sft-data", "default", "0.0.0", "0123abcd"))

def read(name):
    return read_rows(name, field_name="data.train_path", split="train", on_bad_row="skip", stats=ReadStats())

print(json.dumps(read("someone/sft-data")))
for name in ["my_sft_data", "someone/not-cached"]:
    try:
        read(name)
    except ValueError as err:
        print(err)
"""


def test_a_dataset_name_is_looked_up_in_the_local_cache_only(tmp_path):
    """A name that is no local path reads the local `datasets` cache and never asks the Hub, even with
    the offline variables unset (HF_ENDPOINT points at a local server that counts requests)."""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    requests = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            requests.append(self.path)
            self.send_error(404)

        do_HEAD = do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rows = [{"prompt": "1+2", "answer": "3"}, {"prompt": "4+5", "answer": "9"}]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}")
    try:
        run = subprocess.run([sys.executable, "-c", _READ_FROM_CACHE, str(tmp_path / "rows.jsonl")], env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    cached, missing, not_cached = run.stdout.splitlines()
    assert json.loads(cached) == rows
    assert missing.startswith("data.train_path: my_sft_data does not exist (and is no dataset in the local `datasets` cache")
    assert not_cached.startswith("data.train_path: someone/not-cached does not exist (and is no dataset in the local")
    assert requests == []


def test_json_rows_that_are_not_objects_are_bad_rows(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"prompt": "1+2", "answer": "3"}, 7, ["a"], {"prompt": "4+5", "answer": "9"}]))
    stats = ReadStats()
    assert read(path, stats=stats) == [{"prompt": "1+2", "answer": "3"}, {"prompt": "4+5", "answer": "9"}]
    assert stats.bad_rows == 2 and "mixed.json: row 1: a row must be a JSON object, got int" in stats.examples[0]
    with pytest.raises(ValueError, match=r"mixed.json: row 1: a row must be a JSON object.*on_bad_row"):
        read(path, on_bad_row="fail")
    (tmp_path / "ints.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"data.train_path: no usable samples in .*ints.json \(3 malformed rows"):
        from moetune.recipe.config import DataConfig
        from moetune.recipe.dataset import prepare_data

        prepare_data(DataConfig(train_path=str(tmp_path / "ints.json"), test_path=""),
                     AutoTokenizer.from_pretrained(DEFAULT_ASSETS / "tokenizer"), seed=0)


@pytest.mark.parametrize("content, problem", [
    ("", "0 rows read, 0 malformed rows skipped"),
    (json.dumps({"question": "1+2", "reply": "3"}) + "\n", "1 rows read, 1 malformed rows skipped; first problems: "
     "data.test_path: row 0: row has neither a 'messages' column"),
])
def test_a_test_set_without_usable_rows_fails_before_training(tiny_job, tmp_path, monkeypatch, content, problem):
    """Not "exact match 0.0% of 0" after the training: refused before the model is built."""
    from moetune.recipe import train

    test = tmp_path / "test_wrong.jsonl"
    test.write_text(content)
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=rf"data.test_path: no usable rows in .*test_wrong.jsonl \({re.escape(problem)}"):
        train.finetune(tiny_job(data__test_path=test))
