from moetune.models.nemotron_h.model import NemotronHForCausalLM

__all__ = ["NemotronHForCausalLM"]
