"""Hooks into Transformers' extension points (experts implementations)."""

from moetune.integrations.transformers_experts import IMPLEMENTATION_NAME, register_moetune_experts

__all__ = ["IMPLEMENTATION_NAME", "register_moetune_experts"]
