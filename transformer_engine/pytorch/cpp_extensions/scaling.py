"""Scale computation kernels: current scaling (scale from amax) and the delayed-scaling update.

The math is specified in :mod:`transformer_engine.pytorch.reference`
(``compute_scale_from_amax`` and ``delayed_scaling_update``); these wrappers
validate, then run it natively on CUDA tensors or through the reference
elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import reference
from ..constants import TE_DType, to_torch_fp8_dtype
from ._routing import launch_args, native_for, tensor_arg
from ._validation import check_fp32_scalar, check_tensor, check_tensors_on

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "compute_scale_from_amax",
    "current_scale_prevalidated",
    "delayed_scaling_update",
    "delayed_scaling_update_prevalidated",
    "fused_amax_and_scale_update_after_reduction",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_dtype,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Current-scaling scale ``fp8_max / max(amax, epsilon)`` into a one-element float32 tensor."""
    op = "compute_scale_from_amax"
    check_fp32_scalar(op, "amax", amax)
    check_fp32_scalar(op, "out", out)
    if not math.isfinite(float(epsilon)) or float(epsilon) < 0:
        raise ValueError(f"{op}: epsilon={epsilon!r} must be a finite number >= 0")
    dtype = to_torch_fp8_dtype(fp8_dtype)
    check_tensors_on(op, "amax", amax, out=out)

    device = amax.device
    if out is None:
        out = torch.empty(1, dtype=torch.float32, device=device)
    native = native_for(op, device)
    if native is not None:
        native.compute_scale_from_amax(
            tensor_arg(amax), tensor_arg(out), int(_dtype_code(dtype)), float(epsilon),
            bool(force_pow_2_scales), *launch_args(device),
        )  # fmt: skip
    else:
        scale = reference.compute_scale_from_amax(amax, dtype, epsilon, force_pow_2_scales)
        out.view(1).copy_(scale)
    return out


_FLOAT32_CODE = int(TE_DType[torch.float32])


def _dtype_code(dtype: torch.dtype) -> int:
    return int(TE_DType[dtype])


def _check_update_args(
    op: str,
    amax_histories: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    amax_compute_algo: str,
    margin: float,
    amax_reduction_buffer: torch.Tensor | None,
) -> None:
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"{op}: amax_compute_algo={amax_compute_algo!r} is not supported; use 'max' or "
            "'most_recent' (callables run in Python, not in this kernel)"
        )
    if not math.isfinite(float(margin)):
        raise ValueError(f"{op}: margin={margin!r} must be finite")
    if len(amax_histories) != len(scales):
        raise ValueError(
            f"{op}: got {len(amax_histories)} amax histories but {len(scales)} scales; pass one "
            "scale vector per history"
        )
    total = 0
    anchor = amax_histories[0]
    for i, (history, scale) in enumerate(zip(amax_histories, scales)):
        check_tensor(op, f"amax_histories[{i}]", history)
        check_tensor(op, f"scales[{i}]", scale)
        for name, t in ((f"amax_histories[{i}]", history), (f"scales[{i}]", scale)):
            if t.dtype != torch.float32:
                raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
        if history.dim() != 2 or history.shape[0] < 1:
            raise ValueError(
                f"{op}: amax_histories[{i}] has shape {tuple(history.shape)}; expected "
                "[amax_history_len, num_slots] with amax_history_len >= 1"
            )
        if tuple(scale.shape) != (history.shape[1],):
            raise ValueError(
                f"{op}: scales[{i}] has shape {tuple(scale.shape)} but amax_histories[{i}] has "
                f"{history.shape[1]} slots; expected shape ({history.shape[1]},)"
            )
        check_tensors_on(
            op,
            "amax_histories[0]",
            anchor,
            **{f"amax_histories[{i}]": history, f"scales[{i}]": scale},
        )
        total += history.shape[1]
    if amax_reduction_buffer is not None:
        check_tensor(op, "amax_reduction_buffer", amax_reduction_buffer)
        if (
            amax_reduction_buffer.dtype != torch.float32
            or not amax_reduction_buffer.is_contiguous()
        ):
            raise TypeError(f"{op}: amax_reduction_buffer must be a contiguous float32 tensor")
        if amax_reduction_buffer.numel() != total:
            raise ValueError(
                f"{op}: amax_reduction_buffer has {amax_reduction_buffer.numel()} elements but the "
                f"histories have {total} slots in all; it must concatenate row 0 of every history"
            )
        check_tensors_on(
            op, "amax_histories[0]", anchor, amax_reduction_buffer=amax_reduction_buffer
        )


def delayed_scaling_update(
    amax_histories: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    fp8_dtype,
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    amax_reduction_buffer: torch.Tensor | None = None,
) -> None:
    """Roll amax histories and update scales in place, all pairs on one device in one launch.

    ``amax_histories[i]`` is ``[L, N_i]`` float32 and ``scales[i]`` is ``[N_i]``;
    all live on one device. ``amax_reduction_buffer``, when given, holds the
    (e.g. all-reduced) row 0 of every history concatenated in order; its
    non-zero entries replace the history's own row 0. Exact rules in
    :func:`transformer_engine.pytorch.reference.delayed_scaling_update`.
    """
    op = "delayed_scaling_update"
    amax_histories = list(amax_histories)
    scales = list(scales)
    if not amax_histories and not scales:
        return
    dtype = to_torch_fp8_dtype(fp8_dtype)
    _check_update_args(op, amax_histories, scales, amax_compute_algo, margin, amax_reduction_buffer)

    _run_delayed_scaling_update(
        op, amax_histories, scales, dtype, margin, amax_compute_algo, amax_reduction_buffer
    )


def delayed_scaling_update_prevalidated(
    amax_histories, scales, fp8_dtype, margin, amax_compute_algo, amax_reduction_buffer
) -> None:
    """:func:`delayed_scaling_update` without argument checks, for the amax registry, which
    checked every pair when it was registered and builds the reduction buffer itself (the
    per-pair checks would otherwise run at every update step)."""
    if amax_histories:
        _run_delayed_scaling_update(
            "delayed_scaling_update", list(amax_histories), list(scales),
            to_torch_fp8_dtype(fp8_dtype), margin, amax_compute_algo, amax_reduction_buffer,
        )  # fmt: skip


def float32_scratch(device: torch.device, *counts: int) -> tuple[torch.Tensor, list]:
    """One float32 allocation on ``device`` cut into consecutive pieces of ``counts`` elements:
    ``(the buffer, each piece as a native buffer argument)``. Keep the buffer while the call
    runs; the native side gets pointers into it, no tensor views."""
    scratch = torch.empty(sum(counts), dtype=torch.float32, device=device)
    pieces, ptr = [], scratch.data_ptr()
    for count in counts:
        pieces.append((ptr, (count,), _FLOAT32_CODE))
        ptr += 4 * count
    return scratch, pieces


# Float32 slots for the amax pass's per-block maxima of nvte_quantize_current_scaling and
# nvte_compute_current_scale (nvte_amax_workspace_elements; tests/pytorch/kernels/
# test_native_binding.py checks the two agree): with them no memset launch zeroes the amax first.
AMAX_WORKSPACE_ELEMENTS = 1024


def current_scale_prevalidated(
    input: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    epsilon: float,
    force_pow_2_scales: bool,
    reduce_amax=None,
    noop_flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """Current scaling's scale for ``input``: ``amax(input)`` -> ``reduce_amax(amax)`` (e.g. an
    all-reduce, optional) -> :func:`compute_scale_from_amax`, as a new one-element tensor on
    ``input``'s device.

    Without ``reduce_amax``, on CUDA, one native call (``nvte_compute_current_scale``: the amax
    pass and the scale kernel, no memset). ``noop_flag`` (a one-element float32 tensor on the
    device, e.g. a CUDA graph's cached-weight flag) holding 1.0 makes that call read nothing
    and leave the returned scale unwritten: pass it only with a cast that takes the same flag.
    Elsewhere the amax is computed whatever the flag.

    For the current-scaling quantizer, which has checked the input's dtype, that ``fp8_dtype``
    is a torch FP8 dtype and that ``epsilon`` is finite and >= 0 (recipe validation): the
    validated :func:`~.cast.compute_amax` and :func:`compute_scale_from_amax` give the same
    result with more host time per call.
    """
    input = input.contiguous()
    device = input.device
    native = native_for("compute_current_scale", device) if reduce_amax is None else None
    if native is not None:
        scratch, (amax_arg, scale_arg, maxima_arg) = float32_scratch(
            device, 1, 1, AMAX_WORKSPACE_ELEMENTS
        )
        native.compute_current_scale(
            tensor_arg(input), amax_arg, scale_arg, int(_dtype_code(fp8_dtype)), float(epsilon),
            bool(force_pow_2_scales), maxima_arg, tensor_arg(noop_flag), *launch_args(device),
        )  # fmt: skip
        return scratch[1:2]

    def fill_amax(amax: torch.Tensor) -> None:
        native = native_for("compute_amax", input.device)
        if native is not None:
            native.compute_amax(tensor_arg(input), tensor_arg(amax), *launch_args(input.device))
        else:
            amax.copy_(reference.amax(input).reshape(1))

    return current_scale_from(
        fill_amax, input.device, fp8_dtype, epsilon=epsilon,
        force_pow_2_scales=force_pow_2_scales, reduce_amax=reduce_amax,
    )  # fmt: skip


def current_scale_from(
    fill_amax,
    device: torch.device,
    fp8_dtype: torch.dtype,
    *,
    epsilon: float,
    force_pow_2_scales: bool,
    reduce_amax=None,
) -> torch.Tensor:
    """Current scaling's scale from an amax that ``fill_amax(amax)`` writes into a new
    one-element float32 buffer on ``device`` (a producer's amax pass, e.g. an activation's):
    ``reduce_amax(amax)`` (optional) -> :func:`compute_scale_from_amax`, as a new one-element
    tensor. Same caller contract as :func:`current_scale_prevalidated`."""
    amax = torch.empty(1, dtype=torch.float32, device=device)
    scale = torch.empty(1, dtype=torch.float32, device=device)
    fill_amax(amax)
    if reduce_amax is not None:
        reduce_amax(amax)
    native = native_for("compute_scale_from_amax", device)
    if native is not None:
        native.compute_scale_from_amax(
            tensor_arg(amax), tensor_arg(scale), int(_dtype_code(fp8_dtype)), float(epsilon),
            bool(force_pow_2_scales), *launch_args(device),
        )  # fmt: skip
    else:
        computed = reference.compute_scale_from_amax(amax, fp8_dtype, epsilon, force_pow_2_scales)
        scale.copy_(computed.reshape(1))
    return scale


def _run_delayed_scaling_update(
    op, amax_histories, scales, dtype, margin, amax_compute_algo, amax_reduction_buffer
) -> None:
    device = amax_histories[0].device
    native = native_for(op, device)
    if native is not None:
        native.delayed_scaling_update(
            tensor_arg(amax_reduction_buffer), [tensor_arg(h) for h in amax_histories],
            [tensor_arg(s) for s in scales], amax_compute_algo == "max", int(_dtype_code(dtype)),
            float(margin), *launch_args(device),
        )  # fmt: skip
    else:
        reference.delayed_scaling_update(
            amax_histories, scales, dtype, margin, amax_compute_algo, amax_reduction_buffer
        )


def fused_amax_and_scale_update_after_reduction(
    amax_reduction_buffer: torch.Tensor | None,
    amax_histories: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    amax_compute_algo: str,
    fp8_dtype,
    margin: float,
) -> None:
    """Upstream's name and argument order for :func:`delayed_scaling_update`."""
    delayed_scaling_update(
        amax_histories,
        scales,
        fp8_dtype,
        margin=margin,
        amax_compute_algo=amax_compute_algo,
        amax_reduction_buffer=amax_reduction_buffer,
    )
