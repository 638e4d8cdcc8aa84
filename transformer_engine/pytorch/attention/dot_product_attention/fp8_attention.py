"""FP8 attention (the autocast recipe's ``fp8_dpa`` / ``fp8_mha``), by emulation.

Upstream runs FP8 attention in cuDNN's fused FP8 kernels: Q, K and V in FP8 (one scale for the
three), the softmax output ``P`` rounded to FP8 before ``P V``, the output ``O`` in FP8 or high
precision, and in the backward the output gradient ``dO`` and the score gradient (cuDNN's
``dP``, the operand of the ``dQ`` and ``dK`` products) in FP8, each tensor with the scale of its
slot in the module's recipe state (three GEMMs' worth: forward slots 2 = QKV, 3 = O, 8 = S;
backward 0 = dQKV, 3 = dO, 5 = dP).

Here the unfused backend computes the same with those roundings applied to the values it
multiplies: every tensor cuDNN would read in FP8 is quantized with its slot's quantizer (which
records the amax the recipe state needs: delayed scaling's history, reduced and updated like any
module's) and dequantized to float32, and the products, the softmax and its gradient run in
float32, walking the queries in blocks (``score_blocks.py``: the score matrix is never
whole, and the backward recomputes it block by block). So the FP8 rounding of every operand is
upstream's; the accumulation order, and the speed of a fused kernel, are not. A warning says so
once per process.

Recipes: ``DelayedScaling`` (every slot delayed scaling; ``O`` always quantized, as the fused
kernel writes it in FP8), ``Float8CurrentScaling`` (every slot current scaling, ``O`` in high
precision unless ``NVTE_DPA_FP8CS_O_in_F16=0`` or ``fp8_output``; upstream scales ``S`` and
``dP`` with an internal delayed-scaling state of history 1 instead, i.e. with the previous
step's amax, where the current amax is used here), and a ``CustomRecipe`` whose factory answers
the attention slots (roles ``"dpa"``: ``qkv``, ``o``, ``s``, ``dqkv``, ``do``, ``dp``) with
per-tensor FP8 quantizers (``O`` then follows its quantizer's kind as above; anything else is a
``TypeError``). ``NVTE_FP8_DPA_BWD=0`` (or
``bf16_backward=True``) keeps the backward in high precision.
"""

from __future__ import annotations

import os
import warnings

import torch

from ....common.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from ...quantization import FP8GlobalStateManager, QuantizerRole, claim_backward_update
from ...tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from .backends import repeat_kv_heads, softmax_offset
from .score_blocks import attend_in_blocks

__all__ = [
    "Fp8Attention",
    "fp8_attention_recipe_check",
    "fp8_attention_roles",
    "setup_fp8_attention",
]

# Slots of the module's recipe state (three GEMMs: 9 forward, 6 backward).
SLOT_QKV, SLOT_O, SLOT_S = 2, 3, 8
SLOT_DQKV, SLOT_DO, SLOT_DP = 0, 3, 5
_FORWARD_TYPES = {SLOT_QKV: "qkv", SLOT_O: "o", SLOT_S: "s"}
_BACKWARD_TYPES = {SLOT_DQKV: "dqkv", SLOT_DO: "do", SLOT_DP: "dp"}
_WARNED: list = []


def fp8_attention_roles(name: str, *, fwd: bool, num_quantizers: int) -> list:
    """The attention slots' roles (``module_type="dpa"``); ``None`` for the unused slots."""
    types = _FORWARD_TYPES if fwd else _BACKWARD_TYPES
    return [
        QuantizerRole("dpa", types[i], name) if i in types else None for i in range(num_quantizers)
    ]


def setup_fp8_attention(module, device, *, fp8_output, bf16_backward, kv_cache, grad):
    """The :class:`Fp8Attention` of one ``DotProductAttention`` call, or ``None`` when the call
    runs in high precision (no FP8 autocast, or neither ``fp8_dpa`` nor ``fp8_mha`` set).

    With ``NVTE_DPA_FP8_RECIPE=F16`` attention runs in high precision and, as upstream, both
    flags of the autocast recipe itself are set to False; another value gives attention a
    recipe of its own (:func:`attention_recipe`). ``fp8_mha`` without ``fp8_dpa`` sets
    ``fp8_dpa`` (with a warning, as upstream). The module's recipe state (three GEMMs' slots)
    is built on ``device`` here.
    """
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    flags = [f for f in ("fp8_dpa", "fp8_mha") if getattr(recipe, f, False)]
    if not flags:
        return None
    dpa_recipe = os.environ.get("NVTE_DPA_FP8_RECIPE", "")
    if dpa_recipe == "F16":
        for flag in flags:
            setattr(recipe, flag, False)
        return None
    if dpa_recipe:  # attention's own recipe; the autocast recipe stays the linears'
        recipe = attention_recipe(dpa_recipe, recipe)
        if not (recipe.fp8_dpa or recipe.fp8_mha):
            return None
    if recipe.fp8_mha and not recipe.fp8_dpa:
        warnings.warn(
            "fp8_mha=True implies fp8_dpa=True; setting recipe.fp8_dpa=True", stacklevel=4
        )
        recipe.fp8_dpa = True
    fp8_attention_recipe_check(recipe)
    if kv_cache and recipe.fp8_mha:
        raise ValueError(
            "DotProductAttention: fp8_mha with a KV cache (inference_params) has no attention "
            "backend (as upstream); set fp8_mha=False (fp8_dpa=True keeps attention in FP8)"
        )
    if module.return_max_logit:
        raise ValueError(
            "DotProductAttention: return_max_logit=True has no FP8 attention backend; set "
            "fp8_dpa and fp8_mha False, or return_max_logit=False"
        )
    module.__dict__["_fp8_device"] = device
    module.__dict__["_recipe_override"] = recipe if dpa_recipe else None
    module.init_fp8_metadata(num_gemms=3)
    region = FP8GlobalStateManager.quantization_state
    first = region.is_first_fp8_module
    update = claim_backward_update() if grad else None
    attention = Fp8Attention(
        module, fp8_output=fp8_output, bf16_backward=bf16_backward, update=update
    )
    attention.first_flag = first
    return attention


_ATTENTION_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")


def attention_recipe(name: str, autocast_recipe):
    """The recipe ``NVTE_DPA_FP8_RECIPE=name`` gives attention instead of the autocast recipe
    (upstream's switch, for instance delayed-scaling attention among current-scaling linears):
    its format from ``NVTE_DPA_FP8_FORMAT`` (``HYBRID``); delayed scaling's history length,
    amax algorithm and amax reduction from ``NVTE_DPA_FP8DS_AMAX_HISTLEN`` (1),
    ``NVTE_DPA_FP8DS_AMAX_ALGO`` (``most_recent``) and ``NVTE_DPA_FP8DS_REDUCE_AMAX`` (1); its
    ``fp8_dpa`` / ``fp8_mha`` from ``NVTE_DPA_FP8_RECIPE_DPA`` / ``_MHA`` (``1`` or ``0``),
    else the autocast recipe's."""
    env = os.environ
    if name not in _ATTENTION_RECIPES:
        raise ValueError(
            f"DotProductAttention: NVTE_DPA_FP8_RECIPE={name!r} is not one of 'F16', "
            f"{', '.join(repr(n) for n in _ATTENTION_RECIPES)}; unset it to use the autocast "
            "recipe"
        )
    format_name = env.get("NVTE_DPA_FP8_FORMAT", "HYBRID")
    if format_name not in Format.__members__:
        raise ValueError(
            f"DotProductAttention: NVTE_DPA_FP8_FORMAT={format_name!r} is not one of "
            f"{', '.join(Format.__members__)}"
        )
    flags = {}
    for flag in ("fp8_dpa", "fp8_mha"):
        value = env.get(f"NVTE_DPA_FP8_RECIPE_{flag[4:].upper()}")
        flags[flag] = getattr(autocast_recipe, flag, False) if value is None else value == "1"
    fp8_format = Format[format_name]
    if name == "DelayedScaling":
        history = env.get("NVTE_DPA_FP8DS_AMAX_HISTLEN", "1")
        if not history.isdigit() or int(history) < 1:
            raise ValueError(
                f"DotProductAttention: NVTE_DPA_FP8DS_AMAX_HISTLEN={history!r} is not a positive "
                "integer"
            )
        return DelayedScaling(
            fp8_format=fp8_format,
            amax_history_len=int(history),
            amax_compute_algo=env.get("NVTE_DPA_FP8DS_AMAX_ALGO", "most_recent"),
            reduce_amax=env.get("NVTE_DPA_FP8DS_REDUCE_AMAX", "1") != "0",
            **flags,
        )
    if name == "Float8CurrentScaling":
        return Float8CurrentScaling(fp8_format=fp8_format, **flags)
    return MXFP8BlockScaling(fp8_format=fp8_format, **flags)  # refused by the check below


def fp8_attention_recipe_check(recipe) -> None:
    """Refuse the recipes FP8 attention is not built (or not defined) for."""
    if recipe.float8_block_scaling():
        raise ValueError(
            "DotProductAttention: FP8 attention (fp8_dpa / fp8_mha) is not defined for "
            "Float8BlockScaling; set fp8_dpa=False and fp8_mha=False in the recipe"
        )
    if recipe.mxfp8() or recipe.nvfp4():
        raise NotImplementedError(
            f"DotProductAttention: FP8 attention with {type(recipe).__name__} is not built "
            "(upstream runs it on compute capability 10.0 GPUs only); set fp8_dpa=False and "
            "fp8_mha=False, or use DelayedScaling or Float8CurrentScaling"
        )


def _check_slot(quantizer, which: str) -> None:
    if not isinstance(quantizer, (Float8Quantizer, Float8CurrentScalingQuantizer)):
        raise TypeError(
            f"DotProductAttention: FP8 attention needs a per-tensor FP8 quantizer "
            f"(Float8Quantizer or Float8CurrentScalingQuantizer) in its {which} slot, got "
            f"{type(quantizer).__name__}; answer the 'dpa' roles of the CustomRecipe factory "
            "with one"
        )


def _dequantized(quantizer, x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to FP8 by ``quantizer`` (its amax recorded), as float32 values."""
    quantizer.set_usage(rowwise=True, columnwise=False)
    internal, quantizer.internal = quantizer.internal, True
    try:
        q = quantizer.quantize_impl(x.contiguous())
    finally:
        quantizer.internal = internal
    return q.dequantize(dtype=torch.float32)


def _dequantized_together(quantizer, tensors) -> list[torch.Tensor]:
    """Each tensor rounded with one scale for all of them (one quantization of the
    concatenation: one amax), as float32 values of their shapes."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    values = _dequantized(quantizer, flat)
    return [
        part.view(t.shape) for part, t in zip(values.split([t.numel() for t in tensors]), tensors)
    ]


class _QKV(torch.autograd.Function):
    """Q, K, V as their FP8 values (one scale); in backward dQ, dK, dV rounded with the dQKV
    slot (one scale), in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, q, k, v, attention):  # noqa: D102
        ctx.attention, ctx.dtypes = attention, (q.dtype, k.dtype, v.dtype)
        return tuple(_dequantized_together(attention.quantizer(SLOT_QKV), (q, k, v)))

    @staticmethod
    def backward(ctx, dq, dk, dv):  # noqa: D102
        grads = [dq, dk, dv]
        present = [g for g in grads if g is not None]
        if ctx.attention.fp8_backward and present:
            rounded = iter(_dequantized_together(ctx.attention.quantizer(SLOT_DQKV, True), present))
            grads = [None if g is None else next(rounded) for g in grads]
        out = [None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        ctx.attention.backward_done()
        return (*out, None)


class _RoundForward(torch.autograd.Function):
    """The tensor's FP8 values (rounded by ``quantizer``) in forward; the gradient passes
    unchanged."""

    @staticmethod
    def forward(ctx, x, quantizer):  # noqa: D102
        return _dequantized(quantizer, x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


class _RoundBackward(torch.autograd.Function):
    """Identity in forward; the gradient rounded to FP8 by ``attention``'s backward slot
    ``slot``."""

    @staticmethod
    def forward(ctx, x, attention, slot: int):  # noqa: D102
        ctx.attention, ctx.slot = attention, slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        if ctx.attention.fp8_backward:
            grad = _dequantized(ctx.attention.quantizer(ctx.slot, True), grad)
        return grad, None, None


class Fp8Attention:
    """One FP8 attention call's quantization: the module's slot quantizers and the settings.

    The unfused backend hands the call to :meth:`attend`.
    """

    def __init__(self, module, *, fp8_output: bool, bf16_backward: bool, update):
        quantizers = module.quantizers
        self.forward_quantizers = quantizers["scaling_fwd"]
        self.backward_quantizers = quantizers["scaling_bwd"]
        for slot, name in ((SLOT_QKV, "QKV"), (SLOT_O, "O"), (SLOT_S, "S")):
            _check_slot(self.forward_quantizers[slot], f"forward {name} ({slot})")
        self.fp8_backward = not bf16_backward and os.environ.get("NVTE_FP8_DPA_BWD", "1") != "0"
        if self.fp8_backward:
            for slot, name in ((SLOT_DQKV, "dQKV"), (SLOT_DO, "dO"), (SLOT_DP, "dP")):
                _check_slot(self.backward_quantizers[slot], f"backward {name} ({slot})")
        # A current-scaling O slot writes O in high precision unless told otherwise (upstream's
        # NVTE_DPA_FP8CS_O_in_F16); a delayed-scaling one writes it in FP8, as the fused kernel.
        current = isinstance(self.forward_quantizers[SLOT_O], Float8CurrentScalingQuantizer)
        o_in_f16 = current and os.environ.get("NVTE_DPA_FP8CS_O_in_F16", "1") != "0"
        self.fp8_output = fp8_output
        self.round_output = not o_in_f16 and not fp8_output
        self.update = update
        self.first_flag = False
        _warn_once()

    def quantizer(self, slot: int, backward: bool = False):
        return (self.backward_quantizers if backward else self.forward_quantizers)[slot]

    def abandon(self) -> None:
        """The call failed: hand the region's first-module flag back (the backward update
        claimed with it belongs to whichever module runs first next)."""
        FP8GlobalStateManager.quantization_state.is_first_fp8_module = self.first_flag

    def backward_done(self) -> None:
        if self.update is not None:
            self.update.complete()

    def attend(self, problem, dropout_p: float, dropout_ctx, **mask) -> torch.Tensor:
        """The attention output ``[b, hq, sq, dv]`` in the inputs' dtype: Q, K, V rounded
        (:meth:`inputs`), the products in query blocks with the S and dP roundings
        (``score_blocks.py``; ``mask``: its ``positions`` / ``window_left``), O and its
        gradient rounded (:meth:`output`)."""
        q, k, v = self.inputs(problem.q, problem.k, problem.v)
        groups = q.shape[1] // k.shape[1]
        out = attend_in_blocks(
            problem, q, repeat_kv_heads(k, groups), repeat_kv_heads(v, groups),
            softmax_offset(problem, q.device), dropout_p=dropout_p, dropout_ctx=dropout_ctx,
            s_quantizer=self.quantizer(SLOT_S),
            dp_quantizer=self.quantizer(SLOT_DP, True) if self.fp8_backward else None, **mask,
        )  # fmt: skip
        return self.output(out).to(problem.q.dtype)

    def inputs(self, q, k, v):
        """float32 FP8 values of Q, K and V (one scale)."""
        return _QKV.apply(q, k, v, self)

    def output(self, out):
        """``P V``: its gradient rounded (the dO slot), and its value too where the recipe
        writes O in FP8 (delayed scaling; current scaling with ``NVTE_DPA_FP8CS_O_in_F16=0``)."""
        out = _RoundBackward.apply(out, self, SLOT_DO)
        if self.round_output:
            out = _RoundForward.apply(out, self.quantizer(SLOT_O))
        return out

    def fp8_result(self, out: torch.Tensor):
        """``fp8_output=True``: the attention output as a ``Float8Tensor`` of the O slot (the
        gradient passes through unchanged)."""
        quantizer = self.quantizer(SLOT_O)
        quantizer.set_usage(rowwise=True, columnwise=True)
        return quantizer.quantize(out)


def _warn_once() -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            "DotProductAttention: FP8 attention runs by emulation here: Q, K, V, the softmax "
            "output, O and the gradients are rounded to FP8 with the recipe's scales as "
            "upstream's fused kernels round them, and the products run in float32 in the "
            "unfused backend, in blocks of queries (FP8 attention's numerics, not its speed)",
            stacklevel=4,
        )
