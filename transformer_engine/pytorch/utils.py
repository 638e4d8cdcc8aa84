"""Small helpers at upstream's import path ``transformer_engine.pytorch.utils``.

Code written for NVIDIA Transformer Engine imports these (initializers, capability probes, GLU
weight interleaving, divisibility checks), so they live where that code looks for them. Every
question about "which GPU" goes through :mod:`.device`: a probe without a device argument answers
for the device a module built now would land on (the current CUDA device, or the CPU without
CUDA), and the CPU is treated as what it is here, the reference execution path.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import re
from collections.abc import Callable

import torch

from . import device as _device

__all__ = [
    "get_device_compute_capability",
    "get_cudnn_version",
    "is_bf16_available",
    "interleave_glu_tensor",
    "deinterleave_glu_tensor",
]


# ------------------------------------------------------------------ weight initializers


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer that fills a tensor in place from N(0, ``sigma``) and returns it."""
    # A partial of a module-level function, not a closure: modules keep their init method, and
    # torch.save of a whole model pickles it.
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable:
    """N(0, ``sigma / sqrt(2 * num_layers)``): the output-layer init of deep residual stacks."""
    if num_layers <= 0:
        raise ValueError(f"num_layers={num_layers!r} must be positive (std = sigma/sqrt(2*n))")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """The modules' default weight init, N(0, 0.023)."""
    return init_method_normal(0.023)


def init_method_constant(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer that fills a tensor in place with ``val`` and returns it (picklable, as
    :func:`init_method_normal`)."""
    if val == 1.0:
        return torch.nn.init.ones_
    if val == 0.0:
        return torch.nn.init.zeros_
    return functools.partial(torch.nn.init.constant_, val=val)


# ------------------------------------------------------------------ capability probes


def get_device_compute_capability() -> tuple[int, int]:
    """``(major, minor)`` of the current CUDA device.

    Raises ``RuntimeError`` without CUDA: the CPU has no compute capability, and answering
    with a made-up one would let capability checks pass or fail for the wrong reason.
    """
    here = _device.default_device()
    cc = _device.device_compute_capability(here)
    if cc is None:
        raise RuntimeError(
            "get_device_compute_capability: CUDA is not available, so there is no current GPU "
            "to ask; guard the call with torch.cuda.is_available()"
        )
    return cc


def decode_cudnn_version(version: int) -> tuple[int, int, int]:
    """cuDNN's integer version as ``(major, minor, patch)``: 8905 -> (8, 9, 5), 90800 ->
    (9, 8, 0). cuDNN 9 changed the encoding from ``M*1000+m*100+p`` to ``M*10000+m*100+p``."""
    if version < 90000:
        major, rest = divmod(version, 1000)
    else:
        major, rest = divmod(version, 10000)
    minor, patch = divmod(rest, 100)
    return major, minor, patch


def get_cudnn_version() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the cuDNN this process uses.

    This package links no cuDNN of its own; the one in the process is PyTorch's.
    """
    version = torch.backends.cudnn.version()
    if version is None:
        raise RuntimeError(
            "get_cudnn_version: this PyTorch build has no cuDNN (torch.backends.cudnn.version() "
            "is None); install a CUDA build of PyTorch"
        )
    return decode_cudnn_version(int(version))


def is_bf16_available(return_reason: bool = False):
    """Whether BF16 math works on the current device: compute capability 8.0 or newer on a
    GPU; always on the CPU reference path. ``return_reason=True`` gives ``(bool, reason)``,
    the reason ``""`` when available."""
    here = _device.default_device()
    cc = _device.device_compute_capability(here)
    if cc is None or cc[0] >= 8:
        available, reason = True, ""
    else:
        available = False
        reason = f"{here} has compute capability {cc[0]}.{cc[1]}; BF16 needs 8.0 (Ampere) or newer"
    return (available, reason) if return_reason else available


def is_bf16_compatible() -> bool:
    """:func:`is_bf16_available` under the name upstream's releases before it used (still what
    much client and test code imports): a plain bool, no reason."""
    return is_bf16_available()


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether FP8 GEMMs on the current device take non-TN layouts (data-center Blackwell:
    compute capability in [10.0, 12.0) or >= 13.0). False on Ada, Hopper, sm_120 and the CPU,
    where column-wise FP8 usage needs a physically transposed copy."""
    return _device.is_non_tn_fp8_gemm_supported(_device.default_device())


def torch_version() -> tuple[int, ...]:
    """PyTorch's release as a tuple of ints, e.g. ``(2, 6, 0)`` for ``"2.6.0a0+git1234"``.

    Compare with tuples: ``torch_version() >= (2, 4, 0)``.
    """
    match = re.match(r"\d+(?:\.\d+)*", str(torch.__version__))
    if match is None:
        raise RuntimeError(f"torch.__version__={torch.__version__!r} has no release number")
    return tuple(int(part) for part in match.group(0).split("."))


def get_sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device. ``RuntimeError`` without CUDA."""
    here = _device.default_device()
    if here.type != "cuda":
        raise RuntimeError(
            "get_sm_count: CUDA is not available, so there is no current GPU to count the "
            "multiprocessors of; guard the call with torch.cuda.is_available()"
        )
    return torch.cuda.get_device_properties(here).multi_processor_count


# ------------------------------------------------------------------ devices and dtypes


def canonicalize_device(device) -> torch.device:
    """``device`` as a ``torch.device`` with an index for CUDA (``"cuda"`` -> the current
    device, ``None`` -> the current CUDA device, or the CPU without CUDA)."""
    if device is None:
        return _device.default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def canonicalize_dtype(dtype) -> torch.dtype:
    """``dtype`` as a torch dtype (``None`` -> ``torch.get_default_dtype()``)."""
    if dtype is None:
        return torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"canonicalize_dtype: {dtype!r} is not a torch.dtype")
    return dtype


def devices_match(device1, device2) -> bool:
    """Whether two devices are the same one (``"cuda"`` matches ``"cuda:<current>"``)."""
    first, second = torch.device(device1), torch.device(device2)
    if first.type != second.type:
        return False
    if first.type == "cuda":
        return canonicalize_device(first) == canonicalize_device(second)
    return first.index is None or second.index is None or first.index == second.index


def gpu_autocast_ctx(*args, **kwargs):
    """``torch.autocast(device_type="cuda", ...)``: the GPU autocast context upstream's code
    enters (e.g. ``gpu_autocast_ctx(enabled=False)``)."""
    return torch.autocast("cuda", *args, **kwargs)


def clear_tensor_data(*tensors) -> None:
    """Free the memory of tensors that are no longer needed while references to them remain
    (saved activations after their last use): a plain tensor's data is replaced by an empty
    one, a quantized tensor's buffers are released (its ``clear()``). ``None`` is skipped."""
    for tensor in tensors:
        if tensor is None:
            continue
        clear = getattr(tensor, "clear", None)
        if callable(clear) and hasattr(tensor, "update_usage"):  # a quantized tensor or storage
            clear()
        elif isinstance(tensor, torch.Tensor):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class SplitAlongDim(torch.autograd.Function):
    """``SplitAlongDim.apply(tensor, split_dim, split_size_or_sections, squeeze=False)``: the
    parts of ``torch.split(tensor, split_size_or_sections, split_dim)`` as one autograd node
    whose backward concatenates the parts' gradients (a part without a gradient counts as
    zeros). ``squeeze=True`` drops ``split_dim`` from parts of size 1 there (splitting a fused
    ``[..., 3, d]`` QKV tensor into three ``[..., d]`` tensors). A quantized tensor is split by
    its own dispatch (row-wise parts of an FP8 tensor stay FP8)."""

    @staticmethod
    def forward(ctx, tensor, split_dim, split_size_or_sections, squeeze=False):  # noqa: D102
        parts = torch.split(tensor, split_size_or_sections, dim=split_dim)
        ctx.split_dim = split_dim
        ctx.squeeze = bool(squeeze)
        ctx.shapes = [part.shape for part in parts]
        ctx.dtype, ctx.device = tensor.dtype, tensor.device
        if squeeze:
            parts = [part.squeeze(split_dim) for part in parts]
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        full = []
        for grad, shape in zip(grads, ctx.shapes):
            if grad is None:
                grad = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            elif ctx.squeeze:
                grad = grad.unsqueeze(ctx.split_dim)
            full.append(grad)
        return torch.cat(full, dim=ctx.split_dim), None, None, None


# ------------------------------------------------------------------ NVTX ranges


def _nvtx_enabled() -> bool:
    return os.environ.get("NVTE_NVTX_ENABLED", "0") == "1" and torch.cuda.is_available()


def nvtx_range_push(msg: str) -> None:
    """Open an NVTX range named ``msg`` (for Nsight timelines), only with
    ``NVTE_NVTX_ENABLED=1`` and CUDA; otherwise nothing (read at each call)."""
    if _nvtx_enabled():
        torch.cuda.nvtx.range_push(msg)


def nvtx_range_pop(msg: str | None = None) -> None:
    """Close the innermost NVTX range opened by :func:`nvtx_range_push` (``msg`` names it for
    the reader; NVTX closes the innermost range either way)."""
    del msg
    if _nvtx_enabled():
        torch.cuda.nvtx.range_pop()


# ------------------------------------------------------------------ GLU weight layout


def _check_glu_layout(name: str, tensor: torch.Tensor, interleave_size) -> int:
    """``interleave_size`` as an int (any integer type: numpy's, a 0-d integer tensor) after
    the checks both GLU helpers share."""
    try:
        if isinstance(interleave_size, bool):
            raise TypeError
        interleave_size = operator.index(interleave_size)
    except TypeError:
        raise TypeError(f"{name}: interleave_size={interleave_size!r} must be an int") from None
    if interleave_size <= 0:
        raise ValueError(f"{name}: interleave_size={interleave_size} must be positive")
    if tensor.dim() == 0:
        raise ValueError(f"{name}: needs a tensor with at least one dimension, got a scalar")
    rows = tensor.shape[0]
    if rows % (2 * interleave_size) != 0:
        raise ValueError(
            f"{name}: dim 0 of shape {tuple(tensor.shape)} ({rows}) must be a multiple of "
            f"2 * interleave_size = {2 * interleave_size} (the gate and value halves are cut "
            f"into blocks of interleave_size rows)"
        )
    return interleave_size


def interleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """Reorder a GLU weight (or bias) from ``[gate; value]`` halves to alternating blocks.

    Along dim 0, with ``k = interleave_size``: ``[G, V]`` becomes
    ``[G[0:k], V[0:k], G[k:2k], V[k:2k], ...]``. Returns a new tensor of the same shape.
    """
    interleave_size = _check_glu_layout("interleave_glu_tensor", tensor, interleave_size)
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    blocks = tensor.reshape(2, rows // (2 * interleave_size), interleave_size, *rest)
    # clone, not contiguous(): with a single block the transposed view is already contiguous,
    # and the result must never alias the input.
    swapped = blocks.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    return swapped.reshape(tensor.shape)


def deinterleave_glu_tensor(tensor: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """Inverse of :func:`interleave_glu_tensor`: alternating blocks back to ``[gate; value]``.

    Unlike upstream (which fails inside ``reshape``), bad sizes raise the same ``ValueError``
    as :func:`interleave_glu_tensor`.
    """
    interleave_size = _check_glu_layout("deinterleave_glu_tensor", tensor, interleave_size)
    rows, rest = tensor.shape[0], tuple(tensor.shape[1:])
    blocks = tensor.reshape(rows // (2 * interleave_size), 2, interleave_size, *rest)
    swapped = blocks.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    return swapped.reshape(tensor.shape)


# ------------------------------------------------------------------ attention scores


def attention_mask_func(
    attention_scores: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Mask attention scores in place: ``True`` in ``attention_mask`` means masked out, and
    such scores become -10000.0 (finite, so a fully masked row still has a defined softmax).
    Returns ``attention_scores``."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


# ------------------------------------------------------------------ sizes and dtypes


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """``ValueError`` unless ``denominator`` divides ``numerator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder (``ValueError``)."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_dim(
    tensor: torch.Tensor, dim: int, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal views along ``dim`` (``ValueError`` if the
    size does not divide); ``contiguous_split_chunks=True`` makes each chunk contiguous."""
    chunk = divide(tensor.size(dim), num_partitions)
    chunks = torch.split(tensor, chunk, dim=dim)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers; ``ValueError`` for ``b == 0``."""
    if b == 0:
        raise ValueError(f"ceil_div({a}, {b}): the divisor must be non-zero")
    return (a + b - 1) // b


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``; ``ValueError`` for 0."""
    if multiple == 0:
        raise ValueError(f"round_up_to_nearest_multiple({value}, 0): multiple must be non-zero")
    return ceil_div(value, multiple) * multiple


def cast_if_needed(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``tensor`` itself when it already has ``dtype`` (or is ``None``), else a cast copy.

    The cast runs with grad enabled so that it stays on the autograd graph even when called
    from code that disabled grad (e.g. inside an autograd function's forward).
    """
    if tensor is None or tensor.dtype == dtype:
        return tensor
    with torch.enable_grad():
        return tensor.to(dtype=dtype)


def check_dim_for_fp8_exec(tensor: torch.Tensor) -> bool:
    """Whether a 2-D tensor's sizes suit an FP8 GEMM: dim 0 a multiple of 8, dim 1 of 16."""
    return tensor.dim() == 2 and tensor.size(0) % 8 == 0 and tensor.size(1) % 16 == 0


def assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    """``ValueError`` unless every tensor has ``M % 8 == 0`` and ``K % 16 == 0``, where K is the
    last dimension and M the product of the others (what an FP8 GEMM needs)."""
    for tensor in tensors:
        k = tensor.shape[-1] if tensor.dim() > 0 else 1
        m = math.prod(tensor.shape[:-1])
        if m % 8 != 0 or k % 16 != 0:
            raise ValueError(
                f"FP8 execution needs the product of the leading dimensions to be a multiple of "
                f"8 and the last dimension a multiple of 16; got shape {tuple(tensor.shape)} "
                f"(M={m}, K={k}); pad the tensor (e.g. te.Fp8Padding) or run without FP8"
            )
