"""Attention and its helpers: ``DotProductAttention``, ``MultiheadAttention``, rotary position
embeddings and the KV cache for incremental decoding (docs/attention.md)."""
