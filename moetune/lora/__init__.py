"""LoRA for moetune models: attention / dense Linear adapters and one adapter per grouped expert.

See README.md for the math and the mapping to PEFT's adapter format.
"""

from moetune.lora.apply import (
    apply_lora,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    merged_state_dict,
    remove_lora,
    reset_lora_parameters,
)
from moetune.lora.peft_export import export_peft_adapter, peft_adapter_state_dict
from moetune.lora.peft_import import load_peft_adapter
from moetune.lora.settings import LoraSettings

__all__ = [
    "LoraSettings",
    "apply_lora",
    "export_peft_adapter",
    "load_peft_adapter",
    "lora_parameters",
    "lora_state_dict",
    "merge_lora",
    "merged_state_dict",
    "peft_adapter_state_dict",
    "remove_lora",
    "reset_lora_parameters",
]
