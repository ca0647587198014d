"""Validation loss and held-out exact-match accuracy (greedy generation)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from moetune.distributed.inference import gathered_for_inference
from moetune.recipe.distributed_setup import Runtime, all_reduce_sum
from moetune.recipe.formatting import eval_prompt_and_answer
from moetune.recipe.packing import Batch


@dataclass
class EvalSet:
    """Held-out conversations for exact match: prompt (rendered) and expected answer."""

    prompts: list[str]
    answers: list[str]


def build_eval_set(conversations: list[list[dict[str, str]]], tokenizer: PreTrainedTokenizerBase) -> EvalSet:
    pairs = [eval_prompt_and_answer(tokenizer, messages) for messages in conversations]
    return EvalSet(prompts=[p for p, _ in pairs], answers=[a for _, a in pairs])


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[Batch], *, runtime: Runtime,
                    autocast: Callable[[], contextlib.AbstractContextManager],
                    document_offsets: bool = False) -> float | None:
    """Mean loss per answer token over all validation batches of all ranks."""
    was_training = model.training
    model.eval()
    total = count = 0.0
    for batch in batches:  # every rank runs as many (see fixed_batches), labelled or not
        with autocast():
            # num_items_in_batch=1 turns the mean into a sum, so batches weigh by their tokens.
            out = model(**batch.model_inputs(runtime.device, document_offsets=document_offsets), num_items_in_batch=1,
                        output_router_logits=False)
        if batch.num_label_tokens:
            total += float(out.loss)
            count += batch.num_label_tokens
    total, count = all_reduce_sum([total, count], runtime)
    model.train(was_training)
    return total / count if count else None


@torch.no_grad()
def exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eval_set: EvalSet, *,
                device: torch.device, max_new_tokens: int, batch_size: int = 64,
                autocast: Callable[[], contextlib.AbstractContextManager]) -> dict[str, Any]:
    """Fraction of prompts whose greedy completion equals the answer (whitespace-stripped).

    Every rank runs every prompt: with FSDP the forward passes are collectives, and identical
    inputs keep the ranks' generate loops (which stop early at EOS) in lockstep."""
    was_training = model.training
    model.eval()
    completions: list[str] = []
    # FSDP2: the parameters gathered once for all prompts, not once per generated token (where they fit).
    with gathered_for_inference(model):
        for start in range(0, len(eval_set.prompts), batch_size):
            prompts = eval_set.prompts[start:start + batch_size]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                            add_special_tokens=False).to(device)
            with autocast():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            completions += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    correct = [c.strip() == a.strip() for c, a in zip(completions, eval_set.answers)]
    return {"accuracy": sum(correct) / max(1, len(correct)), "num_samples": len(correct),
            "examples": [{"prompt": p, "expected": a, "got": c}
                         for p, a, c in list(zip(eval_set.prompts, eval_set.answers, completions))[:3]]}
