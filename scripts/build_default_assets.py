"""Build the assets of moetune's embedded default fine-tuning job.

Writes, under ``moetune/assets/default/``:

- ``data/train.jsonl``, ``data/test.jsonl``: two-number addition ("23+58" -> "81") as chat
  messages; ``test.jsonl`` holds pairs never seen in training (held-out exact match).
- ``tokenizer/``: a byte-level BPE tokenizer trained here with ``tokenizers`` and saved as a
  Transformers ``PreTrainedTokenizerFast`` with a ChatML chat template (Qwen's format).
- ``model/config.json``: a tiny Qwen3-MoE config (8 experts, top-2, one dense layer).

Everything is deterministic (fixed seed), so re-running it reproduces the shipped files.

    python scripts/build_default_assets.py [--out moetune/assets/default]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig

SEED = 1234
MAX_OPERAND = 99  # operands 0..99: 10,000 distinct problems
NUM_TEST = 400
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen uses; the answer of each assistant turn ends with <|im_end|>, the EOS token.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_problems() -> tuple[list[dict], list[dict]]:
    """All a+b pairs, shuffled with a fixed seed, split into train and held-out test."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(SEED).shuffle(pairs)
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in pairs
    ]
    return rows[NUM_TEST:], rows[:NUM_TEST]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def build_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes, no unknown token) with digits split one by one.

    Single-digit tokens make arithmetic learnable by a tiny model: "81" and "18" share tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=512,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,  # the dense layer's MLP width
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],  # layer 0 dense, layers 1-2 MoE: both code paths are exercised
        decoder_sparse_step=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        architectures=["Qwen3MoeForCausalLM"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parents[1] / "moetune" / "assets" / "default"
    parser.add_argument("--out", type=Path, default=default_out)
    out = parser.parse_args().out

    train, test = make_problems()
    write_jsonl(out / "data" / "train.jsonl", train)
    write_jsonl(out / "data" / "test.jsonl", test)

    # The corpus is the rendered chats plus plain English, so common words get merges too.
    bootstrap = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    bootstrap.chat_template = CHAT_TEMPLATE
    corpus = [bootstrap.apply_chat_template(r["messages"], tokenize=False) for r in train[:2000]]
    corpus += ["user assistant system the answer is what of and to in a question"] * 50
    tokenizer = build_tokenizer(corpus)
    tokenizer.save_pretrained(out / "tokenizer")

    config = build_model_config(tokenizer)
    config.save_pretrained(out / "model")
    print(f"wrote {len(train)} train / {len(test)} test rows, vocab {len(tokenizer)} -> {out}")


if __name__ == "__main__":
    main()
