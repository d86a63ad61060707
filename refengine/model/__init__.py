"""A HuggingFace model folder as both forwards see it: config, validated tensors, tokenizer,
fingerprint; plus the tiny-model generator and the cache of generated models."""
from .config import ModelConfig, load_config
from .loader import Model, load_model

__all__ = ["Model", "ModelConfig", "load_config", "load_model"]
