"""The block zoo (BlockLLM §4): bases, full fine-tunes and LoRA variants
stored as content-addressed blocks, shared on disk and in memory."""

from .blocks import (CorruptAdapter, DuplicateVariant, ShapeMismatch, UnknownBase, UnknownVariant, ZooError,
                     block_hash, block_id, partition)
from .lora import LoraAdapter, load_peft_adapter, merge_into
from .store import LoadedVariant, VariantInfo, Zoo

__all__ = ["ZooError", "UnknownBase", "UnknownVariant", "DuplicateVariant", "ShapeMismatch", "CorruptAdapter",
           "block_id", "partition", "block_hash", "LoraAdapter", "load_peft_adapter", "merge_into", "Zoo",
           "VariantInfo", "LoadedVariant"]
