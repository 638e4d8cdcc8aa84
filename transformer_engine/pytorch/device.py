"""The device seam: the one Python module that asks "which device, which stream".

Everything else receives a device. Kernels run on the device of their input tensor; the current
CUDA device is consulted only here, and only where no tensor says where to go: where a module or
operation builds its parameters (:func:`construction_device`) and where meta parameters are
materialized (:func:`materialization_device`). An impossible placement is refused with
:class:`DevicePlacementError`, which names the owner, the value and the fix. See
docs/architecture.md, the device contract.
"""

from __future__ import annotations

import functools
import threading

import torch

__all__ = [
    "DevicePlacementError",
    "default_device",
    "construction_device",
    "materialization_device",
    "first_storage_device",
    "visible_cuda_devices",
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


class DevicePlacementError(ValueError):
    """A tensor, parameter or kernel was asked to live on a device it cannot be placed on.

    The one error type for impossible placements: ``device="cuda"`` where CUDA is missing,
    materializing onto ``meta``, operands on different devices, meta tensors where data is
    needed. It is a ``ValueError``, so code that caught ``ValueError`` before keeps working.
    """


# ---------------------------------------------------------------------------------------------
# Where parameters are built and materialized: the only questions about the *current* device.

_CPU = torch.device("cpu")


def default_device() -> torch.device:
    """The current CUDA device (with its index) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


def visible_cuda_devices() -> list[torch.device]:
    """Every CUDA device this process can see, in index order; empty without CUDA.

    For questions about all devices at once (e.g. "does every GPU support FP8?").
    """
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", index) for index in range(torch.cuda.device_count())]


def _as_device(who: str, device, fix: str) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError:  # torch's parse error for an unknown device string
        raise DevicePlacementError(f"{who}: device={device!r} is not a device; {fix}") from None


def _pin_cuda_index(who: str, device: torch.device, fix: str) -> torch.device:
    # A CUDA device is only placeable where CUDA exists; an index-less one is pinned to the
    # current index *now*, so the result does not follow later torch.cuda.set_device calls.
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise DevicePlacementError(
            f"{who}: device={str(device)!r} was requested but CUDA is not available here; {fix}"
        )
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


_CONSTRUCTION_FIX = (
    "pass device='cpu' (the reference path) or device='meta' (deferred initialization)"
)
_MATERIALIZATION_WHO = "materializing meta parameters"
_MATERIALIZATION_FIX = "name a device that can hold data, e.g. device='cpu'"


def construction_device(owner: str, device) -> torch.device:
    """Where ``owner`` (a module or operation class name) builds its parameters.

    ``None``: :func:`default_device`. ``"cuda"`` without an index: the current CUDA index,
    pinned now. ``"meta"``: no storage (deferred initialization). A CUDA device where CUDA is
    not available raises :class:`DevicePlacementError` naming ``owner``, the value and the fix.
    """
    if device is None:
        return default_device()
    device = _as_device(owner, device, _CONSTRUCTION_FIX)
    return _pin_cuda_index(owner, device, _CONSTRUCTION_FIX)


def materialization_device(device=None) -> torch.device:
    """Where meta parameters are materialized.

    ``device`` when given (``"cuda"`` without an index: the current CUDA index), else
    :func:`default_device`. ``"meta"`` holds no storage and is refused, as is a CUDA device
    where CUDA is not available (:class:`DevicePlacementError`).
    """
    if device is None:
        return default_device()
    device = _as_device(_MATERIALIZATION_WHO, device, _MATERIALIZATION_FIX)
    if device.type == "meta":
        raise DevicePlacementError(
            "cannot materialize parameters onto the meta device, which holds no data; "
            + _MATERIALIZATION_FIX
        )
    return _pin_cuda_index(_MATERIALIZATION_WHO, device, _MATERIALIZATION_FIX)


def first_storage_device(*tensors: torch.Tensor | None) -> torch.device | None:
    """The device of the first tensor that holds storage (not ``None``, not meta), else ``None``.

    Modules whose meta parameters follow siblings already materialized (e.g. by
    ``module.to_empty(device=...)``) pass this to :func:`materialization_device`.
    """
    for t in tensors:
        if t is not None and not t.is_meta:
            return t.device
    return None


def native_launch_args(device: torch.device) -> tuple[int, int]:
    """``(device_index, stream_handle)`` for a native launch on ``device``.

    The stream is the current stream *of that device*, not of the current
    device, so work lands in the caller's stream order on the right GPU.
    """
    if device.type != "cuda" or device.index is None:
        raise DevicePlacementError(f"native kernels run on an indexed CUDA device, got {device}")
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
            raise DevicePlacementError(
                f"{op}: {name} is a meta tensor and holds no data; materialize it first "
                "(e.g. module.to_empty(device=...) then reset_parameters())"
            )


def check_same_device(op: str, anchor_name: str, anchor: torch.Tensor, **tensors) -> None:
    """Every tensor in ``tensors`` must live on ``anchor``'s device (the execution device)."""
    for name, t in tensors.items():
        if t is not None and t.device != anchor.device:
            raise DevicePlacementError(
                f"{op}: {name} is on {t.device} but {anchor_name} is on {anchor.device}; "
                f"move {name} to {anchor.device} (the execution device is the device of "
                f"{anchor_name})"
            )


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    # Keyed by device index: GPUs of one process may differ (docs/architecture.md, the device
    # contract).
    return torch.cuda.get_device_capability(index)


def device_compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, ``None`` for any other device."""
    if not isinstance(device, torch.device):
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
    # Asked for every FP8 cast and GEMM operand: a CPU (or meta) device answers without
    # building a torch.device or a capability lookup.
    if getattr(device, "type", None) not in (None, "cuda"):
        return False
    cc = device_compute_capability(device)
    if cc is None:
        return False
    return (10, 0) <= cc < (12, 0) or cc >= (13, 0)


# ---------------------------------------------------------------------------------------------
# The forward device guard (docs/architecture.md, the device contract): a per-thread stack of
# the devices that were current before each guarded region, so nesting and activation
# recompute stay balanced.

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


class device_guard:  # noqa: N801 (used like a function: ``with device_guard(d):``)
    """``with device_guard(t.device):`` runs the body with ``t``'s device current.

    A class rather than a generator context manager: every backward enters one, and the
    generator machinery cost more host time than the guard itself."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        enter_device(self.device)

    def __exit__(self, exc_type, exc, tb) -> None:
        exit_device()
