"""Autocast switched off around a kernel wrapper's own PyTorch math.

The wrappers pick their compute dtypes themselves (a float32 product for a float32 output or an
accumulation, the float32 route of :mod:`.hp_gemm_cpu`), as upstream's C++ GEMM does, which
``torch.autocast`` never sees. A PyTorch ``mm``/``addmm``/``linear`` issued inside an autocast
region would instead be cast to the region's 16-bit dtype; this context turns the region off
for the operands' device type while the wrapper computes, and costs one query when it is off.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_off"]


def _enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled()
        return device_type == "cuda" and torch.is_autocast_enabled()


class autocast_off:  # noqa: N801 (used like torch.autocast)
    """``with autocast_off(device_type):`` runs its body with that device type's autocast off."""

    __slots__ = ("_device_type", "_ctx")

    def __init__(self, device_type: str):
        self._device_type = device_type
        self._ctx = None

    def __enter__(self):
        if _enabled(self._device_type):
            self._ctx = torch.autocast(self._device_type, enabled=False)
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(*exc)
