"""Rows -> token ids with labels on the answers only, through the tokenizer's chat template.

Each assistant turn's span is found by rendering the conversation up to that turn (with the
generation prompt) and up to its end: the characters in between are the answer, and every token
whose first character lies there gets a label. This works with any chat template that renders
prefixes consistently (ChatML, Llama, Qwen without reasoning history).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from moetune.recipe.data_sources import ReadStats

IGNORE_INDEX = -100
"""Label of a token that is not trained on (the Transformers / PyTorch convention)."""


@dataclass
class Sample:
    """One tokenized conversation."""

    input_ids: list[int]
    labels: list[int]
    """Same length as input_ids; IGNORE_INDEX except on answer tokens."""


def row_to_messages(row: dict[str, Any], *, messages_column: str, prompt_column: str,
                    answer_column: str) -> list[dict[str, str]] | str:
    """The row's conversation, or a string saying why the row is malformed."""
    if messages_column in row:
        messages = row[messages_column]
        if not isinstance(messages, list) or not messages:
            return f"column {messages_column!r} must be a non-empty list of messages"
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f"every message needs string 'role' and 'content', got {m!r}"
        if not any(m["role"] == "assistant" for m in messages):
            return "the conversation has no assistant message to train on"
        return messages
    if prompt_column in row and answer_column in row:
        prompt, answer = row[prompt_column], row[answer_column]
        if not (isinstance(prompt, str) and isinstance(answer, str)):
            return f"columns {prompt_column!r} and {answer_column!r} must be strings"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return (f"row has neither a {messages_column!r} column (data.messages_column) nor "
            f"{prompt_column!r} and {answer_column!r} columns (data.prompt_column, data.answer_column)")


def answer_spans(tokenizer: PreTrainedTokenizerBase,
                 messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError("model.tokenizer_path: the chat template does not render conversations "
                             "prefix-consistently, so answer tokens cannot be located")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, *, messages_column: str,
                  prompt_column: str, answer_column: str, max_length: int, on_bad_row: str,
                  stats: ReadStats) -> list[Sample]:
    """Tokenize every row; malformed rows are skipped (or fail), long ones truncated, counted."""
    texts, all_spans = [], []
    for index, row in enumerate(rows):
        messages = row_to_messages(row, messages_column=messages_column, prompt_column=prompt_column,
                                   answer_column=answer_column)
        if isinstance(messages, str):
            stats.note_bad(f"row {index}: {messages}", on_bad_row=on_bad_row)
            continue
        text, spans = answer_spans(tokenizer, messages)
        texts.append(text)
        all_spans.append(spans)
    if not texts:
        return []
    # The template already holds the special tokens (BOS, turn markers): add none.
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    samples = []
    for ids, offsets, spans in zip(encoded["input_ids"], encoded["offset_mapping"], all_spans):
        labels = [tok if any(a <= start < b for a, b in spans) else IGNORE_INDEX
                  for tok, (start, _) in zip(ids, offsets)]
        stats.longest = max(stats.longest, len(ids))
        first_answer = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
        if first_answer is None:  # an empty answer: nothing to learn from, whatever the length
            stats.empty += 1
            continue
        if len(ids) > max_length:
            stats.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
            if first_answer >= max_length:
                stats.note_answer_cut(first_answer)
                continue
        samples.append(Sample(input_ids=ids, labels=labels))
    return samples


def eval_prompt_and_answer(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[str, str]:
    """The generation prompt (all turns before the last assistant turn) and the expected answer."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    return prompt, messages[last]["content"]
