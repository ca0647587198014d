"""The job's data, end to end: read, format and tokenize, split off validation, held-out eval set."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from moetune.recipe.config import DataConfig
from moetune.recipe.data_sources import ReadStats, read_rows
from moetune.recipe.evaluation import EvalSet, build_eval_set
from moetune.recipe.formatting import Sample, row_to_messages, tokenize_rows
from moetune.recipe.packing import split_validation


@dataclass
class PreparedData:
    train: list[Sample]
    val: list[Sample]
    eval_set: EvalSet | None
    stats: ReadStats


def prepare_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int) -> PreparedData:
    stats = ReadStats()
    rows = read_rows(config.train_path, field_name="data.train_path", split=config.split,
                     on_bad_row=config.on_bad_row, stats=stats)
    samples = tokenize_rows(rows, tokenizer, messages_column=config.messages_column,
                            prompt_column=config.prompt_column, answer_column=config.answer_column,
                            max_length=config.max_length, on_bad_row=config.on_bad_row, stats=stats)
    if not samples:
        raise ValueError(f"data.train_path: no usable samples in {config.train_path} "
                         f"({stats.dropped(max_length=config.max_length)}). To keep them: "
                         f"{stats.advice(max_length=config.max_length)}")
    train, val = split_validation(samples, fraction=config.val_fraction, seed=seed)
    eval_set = None
    if config.test_path:
        test_stats = ReadStats()
        test_rows = read_rows(config.test_path, field_name="data.test_path", split=config.split,
                              on_bad_row=config.on_bad_row, stats=test_stats)
        conversations = []
        for index, row in enumerate(test_rows):
            messages = row_to_messages(row, messages_column=config.messages_column,
                                       prompt_column=config.prompt_column, answer_column=config.answer_column)
            if isinstance(messages, str):
                test_stats.note_bad(f"data.test_path: row {index}: {messages}", on_bad_row=config.on_bad_row)
                continue
            conversations.append(messages)
        if not conversations:  # refused before training, as an empty training set is: "0.0% of 0" means nothing
            problems = f"; first problems: {' | '.join(test_stats.examples)}" if test_stats.examples else ""
            raise ValueError(f"data.test_path: no usable rows in {config.test_path} ({test_stats.rows} rows read, "
                             f"{test_stats.bad_rows} malformed rows skipped{problems}); fix the file, or set "
                             "data.test_path empty for no held-out accuracy")
        if config.num_eval_samples:
            conversations = conversations[: config.num_eval_samples]
        eval_set = build_eval_set(conversations, tokenizer)
    return PreparedData(train=train, val=val, eval_set=eval_set, stats=stats)


def data_digest(data: PreparedData) -> str:
    """The train and validation samples in a few words and a hash of their tokens: what every rank
    must hold alike (each takes its share of one order of them), which on several nodes can differ
    (a relative path read from another working directory, a node's own copy of the file or tokenizer)."""
    digest = hashlib.sha1()
    for sample in (*data.train, *data.val):
        digest.update(array("q", [len(sample.input_ids), *sample.input_ids, *sample.labels]).tobytes())
    return f"{len(data.train)} train / {len(data.val)} validation samples, tokens sha1 {digest.hexdigest()[:12]}"
