"""Modules: the base module and the layers built on it."""

from .base import TransformerEngineBaseModule
from .layernorm import LayerNorm
from .linear import Linear
from .rmsnorm import RMSNorm

__all__ = ["TransformerEngineBaseModule", "Linear", "LayerNorm", "RMSNorm"]
