"""``DotProductAttention`` and its backends (docs/attention.md)."""

from .dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
