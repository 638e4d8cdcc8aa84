"""What FP8 support exists: per device, per recipe, and the default recipe.

Hardware support is a property of a device (the CPU reference path always supports FP8; a GPU
needs compute capability 8.9 or newer), so it is answered per device and checked where tensors
are quantized, not when an autocast region is entered.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ...common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from ...common.recipe._nvfp4_fields import unbuilt_nvfp4_options
from ..device import device_compute_capability, visible_cuda_devices

__all__ = [
    "is_fp8_available",
    "check_fp8_support",
    "is_mxfp8_available",
    "check_mxfp8_support",
    "is_fp8_block_scaling_available",
    "check_fp8_block_scaling_support",
    "is_nvfp4_available",
    "check_nvfp4_support",
    "get_default_fp8_recipe",
    "get_default_recipe",
    "check_recipe_support",
    "get_align_size_for_quantization",
]


@functools.cache
def _cuda_fp8_support(index: int) -> tuple[bool, str]:
    cc = device_compute_capability(torch.device("cuda", index))
    if cc >= (8, 9):
        return True, ""
    return False, (
        f"cuda:{index} has compute capability {cc[0]}.{cc[1]}; FP8 needs 8.9 (Ada) or newer"
    )


def check_fp8_support(device=None) -> tuple[bool, str]:
    """``(available, reason)`` for FP8 on ``device``.

    ``device=None`` checks every visible CUDA device (all must support FP8) or, without CUDA,
    the CPU reference path, which always does.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                raise ValueError(f"device={device} names no CUDA index; pass e.g. cuda:0")
            return _cuda_fp8_support(device.index)
        if device.type == "meta":
            return False, "meta tensors hold no data; FP8 needs a real device"
        return True, ""
    gpus = visible_cuda_devices()
    if gpus:
        reasons = [r for ok, r in (_cuda_fp8_support(d.index) for d in gpus) if not ok]
        return (not reasons, "; ".join(reasons))
    return True, ""


def is_fp8_available(return_reason: bool = False, device=None):
    """Whether FP8 works (on ``device``, or on every visible GPU, or on CPU without CUDA)."""
    available, reason = check_fp8_support(device)
    return (available, reason) if return_reason else available


def _cuda_mxfp8_support(index: int) -> tuple[bool, str]:
    cc = device_compute_capability(torch.device("cuda", index))
    if (10, 0) <= cc < (12, 0):
        return True, ""
    why = (
        "12.x has no MXFP8 for every GEMM layout" if cc >= (12, 0) else "it needs 10.x (Blackwell)"
    )
    return False, (
        f"MXFP8BlockScaling: cuda:{index} (compute capability {cc[0]}.{cc[1]}) has no native "
        f"MXFP8 GEMM: {why}; under autocast the GEMMs run by exact emulation instead"
    )


def _native_or_emulated_support(recipe: str, what: str, cuda_support, device) -> tuple[bool, str]:
    """``(available, reason)`` of a recipe whose GEMMs are native only on some GPUs
    (``cuda_support(index)``) and emulated everywhere else: False with FP8 unavailable, on the
    CPU, or on a GPU without the native GEMM, each with a reason saying so."""
    fp8_ok, fp8_reason = check_fp8_support(device)
    if not fp8_ok:
        return False, (
            f"{recipe} ({what}) has no native support here; FP8 itself is not available here "
            f"either: {fp8_reason}"
        )
    if device is not None and torch.device(device).type == "cuda":
        return cuda_support(torch.device(device).index)
    gpus = [] if device is not None else visible_cuda_devices()
    if not gpus:
        kind = recipe.removesuffix("BlockScaling")
        return False, (
            f"{recipe}: the CPU has no native {kind} GEMM; under autocast the GEMMs run "
            "by exact emulation (dequantize to float32 and multiply)"
        )
    reasons = [r for ok, r in (cuda_support(d.index) for d in gpus) if not ok]
    return (not reasons, "; ".join(reasons))


def check_mxfp8_support(device=None) -> tuple[bool, str]:
    """``(available, reason)``: native MXFP8 support, upstream's meaning (compute capability
    10.x or 11.x). Elsewhere (Hopper, CPU) it is False, but ``MXFP8BlockScaling`` still runs:
    its GEMMs are emulated on every device (see ``docs/recipes.md``). ``device=None`` checks
    every visible GPU, or the CPU without CUDA."""
    return _native_or_emulated_support(
        "MXFP8BlockScaling", "MXFP8 block scaling", _cuda_mxfp8_support, device
    )


@functools.cache
def _cuda_block_scaling_support(index: int) -> tuple[bool, str]:
    cc = device_compute_capability(torch.device("cuda", index))
    if cc >= (9, 0):
        return True, ""
    return False, (
        f"cuda:{index} has compute capability {cc[0]}.{cc[1]}; FP8 block scaling needs 9.0 "
        "(Hopper) or newer"
    )


def check_fp8_block_scaling_support(device=None) -> tuple[bool, str]:
    """``(available, reason)`` for ``Float8BlockScaling`` on ``device``.

    GPUs of compute capability 9.0 or newer, as upstream (on 9.x the GEMM runs on cuBLASLt's
    blockwise FP8 kernels through the native library, or ``torch._scaled_mm``'s where the torch
    build has them; elsewhere, and on 10.x and newer, on an exact emulation); the CPU reference
    path always. ``device=None``
    checks every visible GPU, or the CPU without CUDA.
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                raise ValueError(f"device={device} names no CUDA index; pass e.g. cuda:0")
            return _cuda_block_scaling_support(device.index)
        if device.type == "meta":
            return False, "meta tensors hold no data; FP8 needs a real device"
        return True, ""
    gpus = visible_cuda_devices()
    reasons = [r for ok, r in (_cuda_block_scaling_support(d.index) for d in gpus) if not ok]
    return (not reasons, "; ".join(reasons))


def _cuda_nvfp4_support(index: int) -> tuple[bool, str]:
    cc = device_compute_capability(torch.device("cuda", index))
    if cc >= (10, 0):
        return True, ""
    return False, (
        f"NVFP4BlockScaling: cuda:{index} (compute capability {cc[0]}.{cc[1]}) has no native "
        "NVFP4 GEMM: it needs 10.0 (Blackwell) or newer; under autocast the GEMMs run by exact "
        "emulation instead"
    )


def check_nvfp4_support(device=None) -> tuple[bool, str]:
    """``(available, reason)``: native NVFP4 support, upstream's meaning (compute capability
    10.0 or newer). Elsewhere (Hopper, CPU) it is False, but ``NVFP4BlockScaling`` still runs:
    its casts are the reference's and its GEMMs are emulated on every device (see
    ``docs/recipes.md``). ``device=None`` checks every visible GPU, or the CPU without CUDA."""
    return _native_or_emulated_support(
        "NVFP4BlockScaling", "NVFP4 block scaling", _cuda_nvfp4_support, device
    )


def is_mxfp8_available(return_reason: bool = False, device=None):
    """Whether MXFP8 is natively supported (see :func:`check_mxfp8_support`)."""
    available, reason = check_mxfp8_support(device)
    return (available, reason) if return_reason else available


def is_fp8_block_scaling_available(return_reason: bool = False, device=None):
    """Whether ``Float8BlockScaling`` runs (see :func:`check_fp8_block_scaling_support`)."""
    available, reason = check_fp8_block_scaling_support(device)
    return (available, reason) if return_reason else available


def is_nvfp4_available(return_reason: bool = False, device=None):
    """Whether NVFP4 is natively supported (see :func:`check_nvfp4_support`)."""
    available, reason = check_nvfp4_support(device)
    return (available, reason) if return_reason else available


def _current_device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return device_compute_capability(torch.device("cuda", torch.cuda.current_device()))


def get_default_fp8_recipe() -> Recipe:
    """The recipe an autocast without ``recipe=`` uses, on the current CUDA device:
    ``Float8CurrentScaling()`` from compute capability 12.0, as upstream, and
    ``DelayedScaling()`` below (and without CUDA). Upstream picks ``MXFP8BlockScaling()`` on
    compute capability 10.x and 11.x, where its MXFP8 GEMMs are native; here they are emulated
    in float32 on every device (``cpp_extensions/mxfp8_gemm.py``), so that default would turn
    the FP8 step silently into a float32 one: those GPUs keep delayed scaling's native per-tensor
    FP8 GEMMs (pass ``MXFP8BlockScaling()`` for upstream's numerics)."""
    cc = _current_device_capability()
    if cc is not None and cc >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()


get_default_recipe = get_default_fp8_recipe


def check_recipe_support(recipe: Recipe) -> None:
    """Refuse recipes this library does not implement, and delayed scaling under compile.

    Field values need no check here: recipes check every field when it is assigned (see
    ``transformer_engine.common.recipe.Recipe``), so a recipe changed since construction is as
    valid as a new one.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe={recipe!r} is not a transformer_engine Recipe")
    if not isinstance(
        recipe,
        (
            DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling,
            NVFP4BlockScaling, CustomRecipe,
        ),
    ):  # fmt: skip
        raise NotImplementedError(
            f"recipe {type(recipe).__name__} is not implemented; use DelayedScaling, "
            "Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling or "
            "CustomRecipe"
        )
    if isinstance(recipe, MXFP8BlockScaling):
        _announce_emulation("MXFP8BlockScaling", "MXFP8")
    if isinstance(recipe, NVFP4BlockScaling):
        unbuilt = unbuilt_nvfp4_options(recipe)
        if unbuilt:
            raise NotImplementedError(
                f"NVFP4BlockScaling: {'; '.join(unbuilt)} not built in this package; leave "
                "these options at their defaults"
            )
        _announce_emulation("NVFP4BlockScaling", "NVFP4")
    if isinstance(recipe, DelayedScaling) and torch.compiler.is_compiling():
        raise RuntimeError(
            "DelayedScaling keeps state across steps and cannot run under torch.compile; use "
            "Float8CurrentScaling"
        )


def check_weight_recipe(owner: str, built: Recipe | None, recipe: Recipe | None) -> None:
    """Refuse to run FP8 weights built under ``quantized_model_init(recipe=built)`` under an
    autocast ``recipe`` of another class, as upstream does: their bytes, scales and (delayed
    scaling) state belong to that recipe, and a GEMM mixing formats, or a delayed-scaling
    weight whose scale nothing updates, would run silently. ``CustomRecipe`` quantizers are the
    user's choice and are not checked."""
    if built is None or recipe is None or built.custom() or recipe.custom():
        return
    if isinstance(recipe, type(built)):
        return
    name = type(built).__name__
    raise RuntimeError(
        f"{owner}: the FP8 weights were built for {name} (quantized_model_init), but the "
        f"autocast recipe is {type(recipe).__name__}; run it under te.autocast(recipe="
        f"{name}(...)), or build the model under quantized_model_init(recipe="
        f"{type(recipe).__name__}(...))"
    )


# Whether each emulated recipe has been announced in this process.
_mxfp8_announced = False
_nvfp4_announced = False


def _announce_emulation(recipe_name: str, fmt: str) -> None:
    """Say once per process and recipe that its GEMMs are emulated: a user who picked it for
    speed must learn that it runs slower than BF16 here, while a user studying its numerics
    (the reason to run it off Blackwell) gets exactly the format's values."""
    flag = f"_{fmt.lower()}_announced"
    if not globals()[flag]:
        globals()[flag] = True
        warnings.warn(
            f"{recipe_name}: GEMMs run by exact emulation ({fmt} operands dequantized to "
            f"float32 and multiplied); the numerics are {fmt}'s, the speed is not (native {fmt} "
            "GEMMs are not built in this package)",
            UserWarning,
            stacklevel=3,
        )


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """Alignment FP8 GEMMs need for this recipe's tensors: 16 for per-tensor FP8, 32 for
    MXFP8, 128 for NVFP4 (upstream's grouped padding); a ``CustomRecipe`` states its own
    (``quantization_alignment``; the factory is not called)."""
    if isinstance(recipe, CustomRecipe):
        return recipe.quantization_alignment
    if isinstance(recipe, NVFP4BlockScaling):
        return 128
    return 32 if isinstance(recipe, MXFP8BlockScaling) else 16
