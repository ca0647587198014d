from moetune.models.gpt_oss.model import GptOssForCausalLM

__all__ = ["GptOssForCausalLM"]
