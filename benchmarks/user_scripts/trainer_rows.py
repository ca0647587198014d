"""Script 1: Transformers' Trainer fine-tunes on fixed-length rows of tokens (run_clm's way: the
dataset holds rows of --max-length tokens; labels are the inputs), bf16, the default optimizer.
Script 5 is the same with ``from moetune import Trainer`` as well (``--moetune-trainer``).

    python trainer_rows.py --import-from transformers|moetune [--moetune-trainer] --checkpoint CKPT --data rows.jsonl ...
"""

from datasets import load_dataset
from harness import Measurement, common_training_arguments, parse_args
from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

args = parse_args(__doc__)
if args.import_from == "moetune":
    from moetune import AutoModelForCausalLM

    if args.moetune_trainer:  # script 5: the second, optional import
        from moetune import Trainer
else:
    from transformers import AutoModelForCausalLM

set_seed(args.seed)
model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=args.dtype)

rows = load_dataset("json", data_files=args.data, split="train")
rows = rows.map(lambda row: {"attention_mask": [1] * len(row["input_ids"]), "labels": row["input_ids"]})

trainer = Trainer(
    model=model,
    args=TrainingArguments(**common_training_arguments(args)),
    train_dataset=rows,
    data_collator=default_data_collator,
    callbacks=[Measurement(args, script="trainer_rows_moetune_trainer" if args.moetune_trainer else "trainer_rows")],
)
trainer.train()
