"""Script 4: TRL's SFTTrainer with PEFT's LoRA (rank 16) on the attention projections and on every
expert's weights (``target_parameters``), on chat samples of 200-3,000 tokens (``--packing`` /
``--padding-free`` as in sft_chat.py).

    python sft_lora.py --import-from transformers|moetune --checkpoint CKPT --data chat.jsonl [--packing] ...
"""

from datasets import load_dataset
from harness import Measurement, common_training_arguments, lora_targets, parse_args
from peft import LoraConfig
from transformers import AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

args = parse_args(__doc__)
if args.import_from == "moetune":
    from moetune import AutoModelForCausalLM
else:
    from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=args.dtype)
tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
samples = load_dataset("json", data_files=args.data, split="train")

attention, experts = lora_targets(model.config.model_type)
peft_config = LoraConfig(
    r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=attention, target_parameters=experts,
    task_type="CAUSAL_LM",
)
config = SFTConfig(
    **common_training_arguments(args),
    packing=args.packing,
    padding_free=args.padding_free,
    max_length=None if args.padding_free and not args.packing else args.max_length,
)
set_seed(args.seed)  # the adapters' initial values
trainer = SFTTrainer(
    model=model, args=config, train_dataset=samples, processing_class=tokenizer, peft_config=peft_config,
    callbacks=[Measurement(args, script="sft_lora_packing" if args.packing else "sft_lora")],
)
trainer.train()
