"""The device seam: the one Python module that asks "which device, which stream".

Everything else receives a device. The library never consults
``torch.cuda.current_device()`` to decide where to allocate or launch: the
execution device is the device of the input tensor (see DESIGN.md, section 3).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

__all__ = [
    "native_launch_args",
    "check_same_device",
    "reject_meta",
    "device_compute_capability",
    "is_non_tn_fp8_gemm_supported",
    "enter_device",
    "exit_device",
    "device_guard",
    "guard_depth",
]


def native_launch_args(device: torch.device) -> tuple[int, int]:
    """``(device_index, stream_handle)`` for a native launch on ``device``.

    The stream is the current stream *of that device*, not of the current
    device, so work lands in the caller's stream order on the right GPU.
    """
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"native kernels run on an indexed CUDA device, got {device}")
    return device.index, _current_raw_stream(device.index)


def _current_raw_stream_via_stream_object(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


# The cudaStream_t of a device's current stream. torch's raw accessor (what compiled code uses)
# skips building a torch.cuda.Stream object, a few microseconds of host time per kernel launch;
# the public route gives the same handle where it is missing.
_current_raw_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", _current_raw_stream_via_stream_object
)


def reject_meta(op: str, **tensors) -> None:
    """Refuse ``meta`` tensors, which have no data to compute on."""
    for name, t in tensors.items():
        if t is not None and t.is_meta:
            raise ValueError(
                f"{op}: {name} is a meta tensor and holds no data; materialize it first "
                "(e.g. module.to_empty(device=...) then reset_parameters())"
            )


def check_same_device(op: str, anchor_name: str, anchor: torch.Tensor, **tensors) -> None:
    """Every tensor in ``tensors`` must live on ``anchor``'s device (the execution device)."""
    for name, t in tensors.items():
        if t is not None and t.device != anchor.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {anchor_name} is on {anchor.device}; "
                f"move {name} to {anchor.device} (the execution device is the device of "
                f"{anchor_name})"
            )


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    # Keyed by device index: GPUs of one process may differ (DESIGN.md section 3.6).
    return torch.cuda.get_device_capability(index)


def device_compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, ``None`` for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index)


def is_non_tn_fp8_gemm_supported(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs on ``device`` take non-TN layouts (data-center Blackwell).

    Where they do not (Ada, Hopper, sm_120 and the CPU reference path), column-wise FP8 usage
    needs a physically transposed copy of the data.
    """
    cc = device_compute_capability(device)
    if cc is None:
        return False
    return (10, 0) <= cc < (12, 0) or cc >= (13, 0)


# ---------------------------------------------------------------------------------------------
# The forward device guard (DESIGN.md section 3.3): a per-thread stack of the devices that were
# current before each guarded region, so nesting and activation recompute stay balanced.

_guard_stack = threading.local()


def _stack() -> list:
    stack = getattr(_guard_stack, "entries", None)
    if stack is None:
        stack = _guard_stack.entries = []
    return stack


def enter_device(device: torch.device) -> None:
    """Make ``device`` current for third-party code in the region (CUDA devices only).

    Costs one comparison when ``device`` is already current. Always pair with
    :func:`exit_device`, also when the region raises.
    """
    previous = None
    if device.type == "cuda":
        current = torch.cuda.current_device()
        if current != device.index:
            torch.cuda.set_device(device.index)
            previous = current
    _stack().append(previous)


def exit_device() -> None:
    """Leave the innermost guarded region, restoring the device that was current before it."""
    previous = _stack().pop()
    if previous is not None:
        torch.cuda.set_device(previous)


def guard_depth() -> int:
    """How many guarded regions are open in this thread (tests check it returns to 0)."""
    return len(_stack())


@contextlib.contextmanager
def device_guard(device: torch.device):
    """``with device_guard(t.device):`` runs the body with ``t``'s device current."""
    enter_device(device)
    try:
        yield
    finally:
        exit_device()
