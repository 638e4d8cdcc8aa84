"""Attention and its helpers: ``DotProductAttention``, ``MultiheadAttention``, rotary position
embeddings and the KV cache for incremental decoding (docs/attention.md,
docs/transformer_layer.md, docs/kv_cache_and_rope.md)."""

from .dot_product_attention import DotProductAttention
from .inference import InferenceParams, KVCacheManager, NonPagedKVCacheManager, PagedKVCacheManager
from .multi_head_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

__all__ = [
    "DotProductAttention",
    "MultiheadAttention",
    "InferenceParams",
    "KVCacheManager",
    "NonPagedKVCacheManager",
    "PagedKVCacheManager",
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
    "apply_fused_qkv_rotary_pos_emb",
]
