"""Model definitions for the native engine (one decoder family per module)."""

from .llama import LlamaForCausalLM, ModelConfig, UnsupportedModel

__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModel"]
