"""Tiny random-weight models saved as Hugging Face directories, so engine
tests exercise the real loading path without downloading anything."""

from __future__ import annotations

from pathlib import Path

import torch

CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=320,
                  max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    # a window much shorter than the test sequences, so windowed attention differs from full attention
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=320, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False, sliding_window=6),
}


def make_tiny_model(kind: str, out_dir: Path, seed: int = 0):
    """Create a random model of ``kind`` with transformers, save it to
    ``out_dir`` (config.json + model.safetensors) and return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(CONFIGS[kind])
    mt = cfg.pop("model_type")
    config = AutoConfig.for_model(mt, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def tiny_engine(layers: int = 2, hidden: int = 64, **engine_kw):
    """A native engine (CPU, the compiled attention where it builds) over a random llama of ``layers``
    layers and width ``hidden``, built in memory: for tests of the engine's own machinery."""
    from interlace.engine_ext.native.engine import NativeEngine
    from interlace.engine_ext.native.models.llama import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.8, 1.2)
    engine_kw.setdefault("attention", "auto")
    engine_kw.setdefault("kv_cache_tokens", 2048)
    return NativeEngine(model.eval(), **engine_kw)
