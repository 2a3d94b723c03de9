"""Llama-family model shared by engine and learner, and its weight I/O."""

from specroll.model.config import ModelConfig
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import ModelOutput, Transformer
from specroll.model.weights import load_model, read_config, save_model

__all__ = [
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "Transformer",
    "load_model",
    "read_config",
    "save_model",
]
