"""Transformer Engine for PyTorch: FP8 training that is correct on any device.

``import transformer_engine`` works with or without the native CUDA library;
``transformer_engine.native_status()`` tells which (``python -m
transformer_engine`` prints it).
"""

from .common.native import NativeStatus, native_status

# The upstream release whose PyTorch surface this package follows: client code gates features on
# it (Megatron-LM passes `device` to the modules only from 0.12 on, so its CPU and meta
# initialization would land on the GPU; Lightning's precision plugin needs >= 0.11), so a lower
# number would change what clients do without a word (docs/compatibility.md).
__version__ = "2.20.0"

__all__ = ["NativeStatus", "native_status", "__version__"]
