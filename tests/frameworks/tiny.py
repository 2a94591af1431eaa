"""The tiny Llama the framework tests train (random weights from a fixed seed, no download)."""

from __future__ import annotations

from typing import Any

import torch


def llama() -> Any:
    """A 2-layer ``LlamaForCausalLM`` (width 64, 4 heads / 2 KV heads, vocab 128), in train mode,
    its weights drawn after ``torch.manual_seed(0)``."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()
