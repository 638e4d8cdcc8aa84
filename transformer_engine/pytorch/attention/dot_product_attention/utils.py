"""Backend selection for ``DotProductAttention`` and the small helpers around it (windows,
``cu_seqlens``).

:func:`get_attention_backend` filters the three backend families by what one call needs
(``AttentionParams``) and by the environment, then picks by priority:

* ``FlashAttention`` -> PyTorch SDPA's FLASH_ATTENTION kernel;
* ``FusedAttention`` -> SDPA's EFFICIENT_ATTENTION (the CUDNN_ATTENTION kernel is never chosen
  automatically: see ``CUDNN_NOT_AUTOMATIC``);
* ``UnfusedDotProductAttention`` -> the explicit float32 implementation (the CPU path).

``NVTE_FLASH_ATTN=0``, ``NVTE_FUSED_ATTN=0`` and ``NVTE_UNFUSED_ATTN=0`` exclude a family;
they are read on every call. With ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2`` the logger
``transformer_engine.pytorch.attention`` prints every filter that fired and the choice.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, NamedTuple

import torch

try:  # upstream's tests compare FlashAttentionUtils' versions with packaging's Version
    from packaging.version import Version as PkgVersion
except ImportError:  # pragma: no cover - packaging is not a dependency; torch's version type
    from torch.torch_version import TorchVersion as PkgVersion

from ...constants import AttnMaskTypes
from ...device import device_compute_capability
from .backends import SDPBackend, causal_bias_api, sdpa_supports

__all__ = [
    "FlashAttentionUtils",
    "AttentionParams",
    "AttentionBackends",
    "SDPAKernel",
    "get_attention_backend",
    "check_set_window_size",
    "get_cu_seqlens",
    "get_full_cu_seqlens",
    "backend_env",
    "logger",
]

logger = logging.getLogger("transformer_engine.pytorch.attention")

MASK_TYPES = AttnMaskTypes


# Measured on an H200 (torch 2.11, CUDA 13): with bshd inputs, SDPA's cuDNN backward returned a
# dq off by up to 4.03 where the test allows 0.021-0.037 (twice the error of the plain BF16/FP16
# composition, plus a floor), for causal with GQA and for no mask; its forward, dk and dv were
# right. The kernel still runs when a
# caller pins it through ``FusedAttention(sdp_backend=...)``; the automatic choice skips it.
CUDNN_NOT_AUTOMATIC = (
    "SDPA's CUDNN_ATTENTION kernel is not chosen automatically: its backward gave a wrong dq "
    "(max error 4.03 against an allowed 0.04) for bshd inputs on torch 2.11; the "
    "memory-efficient kernel runs instead"
)


class FlashAttentionUtils:
    """Upstream's record of the flash-attn package (versions 2 and 3) that its FlashAttention
    backend calls. This implementation never uses that package (its ``FlashAttention`` is
    PyTorch SDPA's flash kernel), so it reads as not installed whether or not it is; upstream
    code and tests branch on these attributes (for instance, to skip flash-attn-only cases)."""

    is_installed = False
    version = PkgVersion("0")
    version_required = PkgVersion("2.1.1")
    version_required_blackwell = PkgVersion("2.7.3")
    max_version = PkgVersion("2.8.3")
    v2_plus = v2_1_plus = v2_3_plus = v2_4_plus = v2_4_1_plus = False
    v2_5_7_plus = v2_6_0_plus = v2_7_0_plus = False
    v3_is_installed = False
    fa3_version = PkgVersion("0")
    v3_0_0_beta = False
    use_v3 = False


class AttentionParams(NamedTuple):
    """Everything about one attention call that decides which backend may run it.

    Field names follow upstream where it has them; the last group is this implementation's.
    Equal parameters give the same choice, which ``DotProductAttention`` caches.
    """

    qkv_type: type = torch.Tensor
    qkv_dtype: torch.dtype = torch.bfloat16
    qkv_layout: str = "sbhd_sbhd_sbhd"
    batch_size: int = 1
    num_heads: int = 16
    num_gqa_groups: int = 16
    max_seqlen_q: int = 128
    max_seqlen_kv: int = 128
    head_dim_qk: int = 64
    head_dim_v: int = 64
    attn_mask_type: str = "no_mask"
    window_size: tuple[int, int] = (-1, -1)
    alibi_slopes_shape: tuple[int, ...] | None = None
    core_attention_bias_type: str = "no_bias"
    core_attention_bias_shape: str | None = None
    core_attention_bias_requires_grad: bool = False
    pad_between_seqs: bool = False
    attention_dropout: float = 0.0
    context_parallel: bool = False
    cp_comm_type: str = "p2p"
    deterministic: bool = False
    is_training: bool = True
    fp8: bool = False
    softmax_type: str = "vanilla"
    return_max_logit: bool = False
    cuda_graph: bool = False
    num_splits: int = 1
    # -- this implementation's --
    device: torch.device = torch.device("cuda")
    bottom_right_diagonal: bool = False
    kv_cache: bool = False
    requires_grad: bool = True
    backend_env: tuple[str, str, str] | None = None  # NVTE_{FLASH,FUSED,UNFUSED}_ATTN


class SDPAKernel(NamedTuple):
    """A PyTorch SDPA kernel and how grouped-query attention reaches it."""

    sdp_backend: Any  # torch.nn.attention.SDPBackend
    repeat_kv: bool = False  # K/V repeated to the query heads (the kernel has no native GQA)


class AttentionBackends(NamedTuple):
    """What :func:`get_attention_backend` returns (upstream's six values, in order)."""

    use_flash_attention: bool
    flash_attention_backend: SDPAKernel | None
    use_fused_attention: bool
    fused_attention_backend: SDPAKernel | None
    use_unfused_attention: bool
    available_backends: list[bool]  # [flash, fused, unfused] after the filters


# -- environment and logging --------------------------------------------------------------------
def backend_env() -> tuple[str, str, str]:
    """``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN`` as set now (default
    "1"). Read on every call on purpose: a test or a user may flip them between calls."""
    get = os.environ.get
    return get("NVTE_FLASH_ATTN", "1"), get("NVTE_FUSED_ATTN", "1"), get("NVTE_UNFUSED_ATTN", "1")


def _configure_debug_logging() -> None:
    """``NVTE_DEBUG=1`` turns the attention logger on: ``NVTE_DEBUG_LEVEL`` 0 warnings,
    1 the choice, 2 the choice and every filter."""
    if os.environ.get("NVTE_DEBUG", "0") != "1":
        return
    level_name = os.environ.get("NVTE_DEBUG_LEVEL", "0")
    level = {"0": logging.WARNING, "1": logging.INFO, "2": logging.DEBUG}.get(level_name)
    if level is None:
        raise ValueError(f"NVTE_DEBUG_LEVEL={level_name!r} must be 0, 1 or 2")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(levelname)s | %(name)s]: %(message)s"))
        logger.addHandler(handler)


# -- windows and cu_seqlens -----------------------------------------------------------------------
def check_set_window_size(attn_mask_type: str, window_size=None) -> tuple[int, int]:
    """The ``(left, right)`` window of ``attn_mask_type`` (``-1``: unbounded).

    Causal types: ``None`` -> ``(-1, 0)``; ``(-1, 0)`` and ``(w >= 0, 0)`` as given;
    ``(-1, -1)`` and ``(w >= 0, r != 0)`` have their right bound set to 0 with a warning.
    Other types: ``None`` -> ``(-1, -1)``; ``(-1, -1)`` and ``(w0 >= 0, w1 >= 0)`` as given;
    ``(-1, 0)`` -> ``(-1, -1)`` with a warning. Anything else is a ``ValueError``.
    """
    causal = "causal" in attn_mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size={window_size!r} must be a pair of ints") from None
    if causal:
        # (-1, -1) means "no window" and (w, r) a window whose right side the causal mask cuts
        # off; (-1, r) for another r is neither
        if left < -1 or (left == -1 and right not in (0, -1)):
            raise ValueError(
                f"window_size={window_size!r} is invalid for attn_mask_type="
                f"{attn_mask_type!r}: use (-1, 0) (no window) or (w, 0) with w >= 0"
            )
        if right != 0:
            warnings.warn(
                f"window_size={window_size!r} has a right bound but attn_mask_type="
                f"{attn_mask_type!r} is causal; using ({left}, 0)",
                stacklevel=3,
            )
        return (left, 0)
    if (left, right) == (-1, 0):
        warnings.warn(
            f"window_size=(-1, 0) is causal but attn_mask_type={attn_mask_type!r} is not; "
            "using (-1, -1)",
            stacklevel=3,
        )
        return (-1, -1)
    if (left, right) == (-1, -1) or (left >= 0 and right >= 0):
        return (left, right)
    raise ValueError(
        f"window_size={window_size!r} is invalid for attn_mask_type={attn_mask_type!r}: use "
        "(-1, -1) or two bounds >= 0"
    )


def get_cu_seqlens(mask: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths (int32 ``[b + 1]``) of a padding mask ``[b, 1, 1, s]``
    (True = padded): the running sum of each sequence's unmasked tokens."""
    lengths = (~mask.reshape(mask.shape[0], -1)).sum(dim=1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    return torch.cat([zero, torch.cumsum(lengths, dim=0, dtype=torch.int32)])


def get_full_cu_seqlens(batch_size: int, max_seqlen: int, device) -> torch.Tensor:
    """``cu_seqlens`` of ``batch_size`` sequences of ``max_seqlen`` tokens each (int32)."""
    return torch.arange(
        0, (batch_size + 1) * max_seqlen, max_seqlen, dtype=torch.int32, device=device
    )


# -- selection ------------------------------------------------------------------------------------
def needs_materialized_mask(params: AttentionParams) -> str | None:
    """Why a call needs a mask tensor (a reason string), ``None`` when a causal flag or
    nothing describes it."""
    if "thd" in params.qkv_layout:
        return "the thd format runs as padded batches with a padding mask"
    if params.attn_mask_type.startswith("padding") or params.attn_mask_type == "arbitrary":
        return f"attn_mask_type={params.attn_mask_type!r} needs a mask tensor"
    if params.kv_cache:
        return "the KV cache needs a padding mask"
    left, right = params.window_size
    causal = "causal" in params.attn_mask_type
    if left >= 0 or (right >= 0 and not causal):
        return f"window_size={params.window_size} needs a mask tensor"
    if _bottom_right_causal(params) and params.max_seqlen_q > params.max_seqlen_kv:
        return "a bottom-right causal diagonal with max_seqlen_q > max_seqlen_kv needs a mask"
    return None


def _bottom_right_causal(params: AttentionParams) -> bool:
    if "causal" not in params.attn_mask_type:
        return False
    return params.bottom_right_diagonal or params.attn_mask_type.endswith("bottom_right")


def _common_sdpa_filters(params: AttentionParams, dtypes) -> list[str]:
    reasons = []
    if params.device.type != "cuda":
        reasons.append(
            f"PyTorch's SDPA kernels are used on CUDA devices only (got {params.device})"
        )
    elif not torch.cuda.is_available():
        reasons.append("CUDA is not available")
    if params.qkv_dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        reasons.append(f"qkv_dtype={params.qkv_dtype} is not one of {names}")
    if params.fp8:
        reasons.append("FP8 attention is not supported")
    if params.context_parallel:
        reasons.append("context parallelism is not supported")
    return reasons


def _flash_and_cudnn_filters(params: AttentionParams) -> list[str]:
    """What both the flash and the cuDNN kernels refuse (they take no mask and no bias)."""
    reasons = _common_sdpa_filters(params, (torch.float16, torch.bfloat16))
    if not reasons:
        cc = device_compute_capability(params.device)
        if cc is not None and cc < (8, 0):
            reasons.append(f"compute capability {cc} < 8.0")
    if params.head_dim_qk != params.head_dim_v:
        reasons.append(f"head_dim_qk={params.head_dim_qk} != head_dim_v={params.head_dim_v}")
    if params.head_dim_qk > 256:
        reasons.append(f"head_dim_qk={params.head_dim_qk} > 256")
    mask_reason = needs_materialized_mask(params)
    if mask_reason:
        reasons.append(mask_reason)
    if params.core_attention_bias_type != "no_bias":
        reasons.append(f"core_attention_bias_type={params.core_attention_bias_type!r}")
    if params.softmax_type != "vanilla":
        reasons.append(f"softmax_type={params.softmax_type!r}")
    return reasons


def _filters(params: AttentionParams, env) -> dict[str, list[str]]:
    """Reasons each candidate cannot run this call (empty list: it can)."""
    flash_env, fused_env, unfused_env = env
    flash = _flash_and_cudnn_filters(params)
    cudnn = [CUDNN_NOT_AUTOMATIC, *flash]
    if "causal" in params.attn_mask_type and params.max_seqlen_q != params.max_seqlen_kv:
        if not _bottom_right_causal(params):
            flash.append("SDPA's flash kernel refuses a top-left causal mask with sq != skv")
        elif causal_bias_api()[1] is None:
            flash.append("this torch has no torch.nn.attention.bias.causal_lower_right")
        # SDPA's causal flag is top-left by definition, but which corner a cuDNN version
        # aligns to is not: leave both cases to the memory-efficient kernel
        cudnn.append("a causal mask with sq != skv is left to the memory-efficient kernel")
    if params.attention_dropout > 0.0:
        cudnn.append("attention dropout is left to the flash and memory-efficient kernels")
    efficient = _common_sdpa_filters(params, (torch.float16, torch.bfloat16, torch.float32))
    if params.deterministic and params.is_training:
        why = "deterministic training: the kernel's backward is not deterministic"
        cudnn.append(why)
        efficient.append(why)
    if flash_env == "0":
        flash.insert(0, "disabled by NVTE_FLASH_ATTN=0")
    if fused_env == "0":
        cudnn.insert(0, "disabled by NVTE_FUSED_ATTN=0")
        efficient.insert(0, "disabled by NVTE_FUSED_ATTN=0")
    unfused = ["disabled by NVTE_UNFUSED_ATTN=0"] if unfused_env == "0" else []
    return {"flash": flash, "cudnn": cudnn, "efficient": efficient, "unfused": unfused}


def _sdp(name: str):
    return None if SDPBackend is None else getattr(SDPBackend, name)


def get_attention_backend(attention_params: AttentionParams, problem=None) -> AttentionBackends:
    """Choose the backend for ``attention_params`` (see the module docstring).

    ``problem`` (an ``AttentionProblem`` with the call's tensors, passed by
    ``DotProductAttention``) lets PyTorch confirm that an SDPA kernel accepts the actual
    tensors (``torch.backends.cuda.can_use_*``); without it the static filters decide.
    Raises ``ValueError`` naming every filter when no backend fits.
    """
    _configure_debug_logging()
    params = attention_params
    env = params.backend_env or backend_env()
    reasons = _filters(params, env)
    if SDPBackend is None:
        for name in ("flash", "cudnn", "efficient"):
            reasons[name].append("this torch has no torch.nn.attention.SDPBackend")
    kernels = {"flash": None, "cudnn": None, "efficient": None}
    for name, sdp_name in (
        ("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
    ):  # fmt: skip
        if reasons[name]:
            continue
        backend = _sdp(sdp_name)
        repeat_kv = False
        if problem is not None:
            ok, repeat_kv, why = sdpa_supports(backend, problem, params.attention_dropout)
            if not ok:
                reasons[name].append(f"PyTorch refuses these tensors: {why}")
                continue
        kernels[name] = SDPAKernel(backend, repeat_kv)
        if problem is not None:
            break  # the first kernel PyTorch confirms wins; the rest need not be asked
    for name, why in reasons.items():
        if why:
            logger.debug("Disabling %s attention: %s", name, "; ".join(why))
    use_flash = kernels["flash"] is not None
    fused_kernel = kernels["cudnn"] or kernels["efficient"]
    use_fused = fused_kernel is not None and not use_flash
    use_unfused = not reasons["unfused"] and not use_flash and not use_fused
    available = [use_flash, fused_kernel is not None, not reasons["unfused"]]
    if not (use_flash or use_fused or use_unfused):
        detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in reasons.items() if why)
        raise ValueError(
            f"No dot product attention backend is available for this call ({detail}). Run "
            "with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to log the filters, or allow a backend "
            "(NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN)"
        )
    chosen = "FlashAttention" if use_flash else "FusedAttention" if use_fused else "Unfused"
    if use_fused:
        chosen += f" ({fused_kernel.sdp_backend.name})"
    logger.info("Running with %s backend for %s", chosen, _describe(params))
    return AttentionBackends(
        use_flash, kernels["flash"], use_fused, fused_kernel if use_fused else None,
        use_unfused, available,
    )  # fmt: skip


def _describe(params: AttentionParams) -> str:
    return (
        f"qkv_layout={params.qkv_layout}, dtype={params.qkv_dtype}, "
        f"mask={params.attn_mask_type}, window={params.window_size}, "
        f"sq={params.max_seqlen_q}, skv={params.max_seqlen_kv}, "
        f"heads={params.num_heads}/{params.num_gqa_groups}, "
        f"d={params.head_dim_qk}/{params.head_dim_v}, device={params.device}"
    )
