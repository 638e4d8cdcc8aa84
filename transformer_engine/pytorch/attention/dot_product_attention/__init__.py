"""``DotProductAttention`` and its backends (docs/attention.md)."""

# _attention_backends (the backend-selection cache) is re-exported because upstream's attention
# tests import it from this package to force a new selection.
from .dot_product_attention import DotProductAttention, _attention_backends

__all__ = ["DotProductAttention"]
