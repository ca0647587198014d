"""Scripts 2 and 3: TRL's SFTTrainer on chat samples of 200-3,000 tokens (pre-tokenised), padded per
batch; ``--packing`` packs them into rows of --max-length tokens (TRL's best-fit packing, padding-free
batches), ``--padding-free`` flattens each batch into one row without packing.

    python sft_chat.py --import-from transformers|moetune --checkpoint CKPT --data chat.jsonl [--packing | --padding-free] ...
"""

from datasets import load_dataset
from harness import Measurement, common_training_arguments, parse_args
from transformers import AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

args = parse_args(__doc__)
if args.import_from == "moetune":
    from moetune import AutoModelForCausalLM
else:
    from transformers import AutoModelForCausalLM

set_seed(args.seed)
model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=args.dtype)
tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
samples = load_dataset("json", data_files=args.data, split="train")

config = SFTConfig(
    **common_training_arguments(args),
    packing=args.packing,
    padding_free=args.padding_free,
    # Padding-free batches without packing are not truncated by TRL: the samples are short enough.
    max_length=None if args.padding_free and not args.packing else args.max_length,
)
name = "sft_packing" if args.packing else "sft_padding_free" if args.padding_free else "sft_padded"
trainer = SFTTrainer(
    model=model, args=config, train_dataset=samples, processing_class=tokenizer,
    callbacks=[Measurement(args, script=name)],
)
trainer.train()
