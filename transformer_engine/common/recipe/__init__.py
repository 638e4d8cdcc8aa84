"""Quantization recipes: configuration objects that say how tensors are cast to FP8.

A recipe is pure configuration. It holds no tensors and imports neither torch nor
``transformer_engine.pytorch``; the quantization state built from it (scales, amax histories,
quantizers) lives in ``transformer_engine.pytorch``. Recipes are mutable dataclasses, as
upstream's are: they compare field by field, are not hashable, and their fields (and any other
attribute) may be assigned after construction. Constructors and field assignments accept and
convert values as upstream's pydantic dataclasses do (``amax_history_len=16.0`` is 16,
``reduce_amax=1`` is True, ``margin="2"`` is 2; see ``_field_checks.py``), and drop unknown
keyword arguments with a ``UserWarning`` (``_lenient_init.py``). Every field is checked at
construction and on every assignment: a bad value raises ``RecipeTypeError`` (wrong type; both a
``TypeError`` and a ``ValueError``) or ``ValueError`` (wrong value) naming the field, the value and
the fix. Modules and operations compare the recipe they run with against a copy of the one their
state was built from, so a recipe changed between steps refreshes that state exactly as an equal
new recipe would. ``MMParams`` and ``QParams`` are frozen (hashable), as upstream's are.

Six recipes: :class:`DelayedScaling` (per-tensor scales from a history of earlier amaxes),
:class:`Float8CurrentScaling` (per-tensor scales from the tensor being cast),
:class:`Float8BlockScaling` (one scale per 1x128 tile or 128x128 block), :class:`MXFP8BlockScaling`
(one E8M0 scale per 32 elements), :class:`NVFP4BlockScaling` (FP4 with one E4M3 scale per 16
elements and a tensor scale) and :class:`CustomRecipe` (quantizers from a user factory). Their
scaling math is described in ``docs/recipes.md`` and ``docs/numerics.md``.

Environment variables (each read at construction time):
``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` (``"1"``: ``Float8CurrentScaling.use_power_2_scales``
defaults to True; its class-level ``fp8_quant_*`` read it once, at import);
``NVTE_BACKWARD_OVERRIDE`` (default ``backward_override`` of every recipe but ``DelayedScaling``:
unset or empty means None, else ``"high_precision"`` or ``"dequantized"``);
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` (``"1"``: ``Float8BlockScaling.use_f32_scales`` defaults to
True; its class-level ``fp8_quant_*`` read it once, at import); the ``NVTE_NVFP4_*`` variables of
``NVFP4BlockScaling`` (see ``_nvfp4_fields.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, NamedTuple

from ._compat_arguments import check_interval, check_override_linear_precision
from ._field_checks import (
    RecipeTypeError,
    backward_override_from_env,
    check_alignment,
    check_amax_compute_algo,
    check_backward_override,
    check_bool,
    check_delayed_backward_override,
    check_int_at_least,
    check_optional_callable,
    check_qfactory,
    power_2_scales_from_env,
    type_name,
)
from ._formats import (
    Format,
    MMParams,
    QParams,
    _check_block_dims_together,
    _check_block_scaling_dim,
    _check_false,
    _check_fp8_format,
    _check_mm_params,
    _check_split_accumulator,
    _FormatMaxima,
    _import_time_block_qparams,
    _import_time_role_qparams,
    fp32_scales_from_env,
)
from ._lenient_init import LenientInit, warn_if_misspelt_field
from ._nvfp4_fields import _NVFP4Fields

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
]

# The public path, for reprs and pickles (defined in _formats.py and _field_checks.py).
for _cls in (Format, MMParams, QParams, _FormatMaxima, RecipeTypeError):
    _cls.__module__ = __name__
del _cls


# ------------------------------------------------------------------ recipes


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


class Recipe(metaclass=LenientInit):
    """Base class of every quantization recipe.

    The predicates below test the recipe's class; they are classmethods, so they work on a
    class (``DelayedScaling.delayed()``) and on an instance (``recipe.delayed()``) alike.
    Predicates for recipe families this project does not implement return False.

    Recipes are mutable, as upstream's are: code assigns fields of a recipe it already built
    (``recipe.amax_history_len = 16``). Every assignment, including the constructor's own, is
    checked (and converted, as the constructor converts) by the same per-field check, so a bad
    value raises at the line that assigned it, naming the field and the value, instead of
    reaching the kernels. (Upstream does not check assignments at all; checking at autocast
    entry instead would report the mistake far from where it was made, and nothing upstream
    assigns is refused: its recipe checks are each about one field.) Other attributes may be
    set freely, as upstream allows (``recipe.my_tag = 1``); one whose name is close to a
    field's (``amax_histroy_len``) is set with a ``UserWarning``, as it changes nothing.
    """

    # Per-field checks of a subclass: ``{field name: check(owner, name, value) -> value}``.
    _field_checks: ClassVar[dict[str, Callable[[str, str, Any], Any]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        if dataclasses.is_dataclass(cls):
            if name in _field_names(cls):
                check = cls._field_checks.get(name)
                if check is not None:
                    value = check(cls.__name__, name, value)
            elif name[:1] != "_" and not hasattr(cls, name):
                warn_if_misspelt_field(cls, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if dataclasses.is_dataclass(type(self)) and name in _field_names(type(self)):
            raise AttributeError(
                f"{type(self).__name__}.{name} is a recipe field and cannot be deleted; assign "
                f"a new value instead"
            )
        object.__delattr__(self, name)

    @classmethod
    def nvfp4(cls) -> bool:
        """Whether this is an :class:`NVFP4BlockScaling` recipe."""
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        """Whether this is an :class:`MXFP8BlockScaling` recipe."""
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def delayed(cls) -> bool:
        """Whether this is a :class:`DelayedScaling` recipe."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """Whether this is a :class:`Float8CurrentScaling` recipe."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """Whether this recipe uses one FP8 scale per tensor (delayed or current scaling)."""
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """Whether this is a :class:`Float8BlockScaling` recipe."""
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        """Whether this is a :class:`CustomRecipe` (quantizers chosen by a user factory)."""
        return issubclass(cls, CustomRecipe)


# Which modules share one set of amax buffers (reduced and updated together) is decided by recipe
# *equality* (transformer_engine.pytorch.quantization.AmaxKey), so a recipe rebuilt every step
# (`autocast(recipe=DelayedScaling(...))` inside the training loop) keeps its modules in one
# group, on every rank. Recipes whose `amax_compute_algo` / `scaling_factor_compute_algo` are
# different callables are different groups, each updated with its own callables; a lambda made
# afresh every step therefore moves its modules to a new group every step (correct, but it
# re-registers them each time: define the callable once). The reprs below list plain values only
# (a callable prints with its memory address); upstream's string key helpers still use them.


@dataclasses.dataclass(repr=False)
class DelayedScaling(Recipe):
    """FP8 training with delayed scaling: scales come from the amaxes of earlier steps.

    Every FP8 cast records the amax (``max |x|``) of its input. At the end of the forward pass
    (exit of the outermost autocast) and of the backward pass, the recorded amaxes are, when
    requested, all-reduced across ranks, appended to a history of ``amax_history_len`` steps,
    and each tensor's next scale is computed from that history as
    ``fp8_max * 2**-margin / amax``. The casts of step ``k`` therefore use scales from steps
    before ``k``. See ``docs/numerics.md`` for the exact rules.

    Parameters
    ----------
    margin : int, default 0
        Headroom: scales are divided by ``2**margin``. An int >= 0.
    fp8_format : Format, default Format.HYBRID
        ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) or ``Format.E4M3``.
    amax_history_len : int, default 1024
        Number of steps in the amax history window. An int >= 1.
    amax_compute_algo : {"max", "most_recent"} or callable, default "max"
        Which amax the scale is computed from: the maximum over the history window
        (``"max"``), the amax of the latest step only (``"most_recent"``), or the result of a
        callable taking the history tensor ``[amax_history_len, N]`` and returning an amax
        tensor ``[N]``.
    scaling_factor_compute_algo : callable, optional
        Custom scale function ``(amax, scale, fp8_max, recipe) -> new_scale``; None uses the
        default formula above.
    reduce_amax : bool, default True
        All-reduce (MAX) the amaxes over the autocast's ``amax_reduction_group`` before the
        update, when ``torch.distributed`` is initialized with more than one rank. With False
        each rank keeps its own scales (and every rank must then save its checkpoint).
    fp8_dpa : bool, default False
        (Beta) FP8 dot-product attention: attention casts its inputs to FP8 internally.
    fp8_mha : bool, default False
        (Beta) FP8 multi-head attention: no casts at the attention boundaries; the QKV
        projection produces FP8 and the output projection consumes it.
    interval, override_linear_precision : keyword-only, optional
        Arguments of older releases, accepted so that code passing them (Megatron-LM,
        accelerate) runs; they change nothing and are not stored. ``interval`` (an int >= 1)
        other than 1, and ``override_linear_precision`` (three bools ``(fprop, dgrad, wgrad)``)
        with a True entry, draw a ``UserWarning``: scales update every step and all GEMMs run
        in FP8, as in current upstream.
    backward_override : None
        Must be None: delayed scaling always runs the backward pass in FP8. Unlike
        :class:`Float8CurrentScaling` the default ignores ``NVTE_BACKWARD_OVERRIDE``, so a
        process-wide setting meant for current scaling does not make every ``DelayedScaling()``
        fail; an explicit non-None value raises ``ValueError``.

    Raises
    ------
    RecipeTypeError
        A field has the wrong type (a ``TypeError`` and a ``ValueError``).
    ValueError
        A field has an unsupported value.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[[Any], Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    # Keyword-only constructor arguments of older releases that clients still pass (Megatron-LM,
    # accelerate): checked, warned about where they ask for something not done, never stored.
    # See _compat_arguments.py.
    _: dataclasses.KW_ONLY
    interval: dataclasses.InitVar[int | None] = None
    override_linear_precision: dataclasses.InitVar[tuple[bool, bool, bool] | None] = None

    _field_checks = {
        "margin": lambda owner, name, value: check_int_at_least(owner, name, value, 0),
        "fp8_format": _check_fp8_format,
        "amax_history_len": lambda owner, name, value: check_int_at_least(owner, name, value, 1),
        "amax_compute_algo": check_amax_compute_algo,
        "scaling_factor_compute_algo": check_optional_callable,
        "reduce_amax": check_bool,
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_delayed_backward_override,
    }

    def __post_init__(self, interval: Any, override_linear_precision: Any) -> None:
        check_interval(type(self).__name__, interval)
        check_override_linear_precision(type(self).__name__, override_linear_precision)

    def __repr__(self) -> str:
        # Plain values only: see the comment above this class.
        return (
            f"recipe_type={type(self).__name__}, "
            f"margin={self.margin}, "
            f"format={self.fp8_format.name}, "
            f"amax_history_len={self.amax_history_len}, "
            f"reduce_amax={self.reduce_amax}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}"
        )


@dataclasses.dataclass(repr=False)
class Float8CurrentScaling(Recipe):
    """FP8 training with current (just-in-time) per-tensor scaling.

    Each cast computes the amax of the tensor it is about to cast and derives the scale from
    it, ``fp8_max / max(amax, amax_epsilon)`` (no margin, no history), so there is no state to
    keep between steps. See ``docs/numerics.md`` for the exact rules.

    Parameters
    ----------
    use_power_2_scales : bool, default from ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``
        Round scales down to powers of 2. Defaults to True exactly when the environment
        variable is ``"1"`` at construction time.
    fp8_format : Format, default Format.HYBRID
        ``Format.HYBRID`` (E4M3 forward, E5M2 gradients) or ``Format.E4M3``.
    fp8_gemm_fprop : MMParams, default MMParams(use_split_accumulator=False)
        Options of the forward GEMM.
    fp8_gemm_dgrad : MMParams, default MMParams(use_split_accumulator=True)
        Options of the input-gradient GEMM.
    fp8_gemm_wgrad : MMParams, default MMParams(use_split_accumulator=True)
        Options of the weight-gradient GEMM.
    fp8_dpa : bool, default False
        (Beta) FP8 dot-product attention.
    fp8_mha : bool, default False
        (Beta) FP8 multi-head attention (no casts at the attention boundaries).
    backward_override : {None, "high_precision", "dequantized"}, default from env
        None runs the backward pass in FP8. ``"high_precision"`` computes it from the original
        high-precision operands; ``"dequantized"`` from the saved FP8 operands dequantized to
        the compute dtype. Defaults to ``NVTE_BACKWARD_OVERRIDE`` at construction time (unset
        or empty means None).

    Attributes
    ----------
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad : QParams
        Class attributes, not constructor arguments: per-role quantization parameters
        ``QParams(power_2_scale=<NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES == "1">,
        amax_epsilon=0.0)``, fixed when this module is imported. Passed to the constructor they
        are ignored with a warning, as upstream ignores them; assigned on a recipe, they apply
        to that recipe.

    Raises
    ------
    RecipeTypeError
        A field has the wrong type (a ``TypeError`` and a ``ValueError``).
    ValueError
        A field has an unsupported value.
    """

    use_power_2_scales: bool = dataclasses.field(default_factory=power_2_scales_from_env)
    fp8_format: Format = Format.HYBRID
    # Class-wide constants, so they cannot follow a later change of the environment; they are
    # the per-role parameters quantizers of the input, weight and gradient roles start from.
    fp8_quant_fwd_inp: ClassVar[QParams] = _import_time_role_qparams()
    fp8_quant_fwd_weight: ClassVar[QParams] = _import_time_role_qparams()
    fp8_quant_bwd_grad: ClassVar[QParams] = _import_time_role_qparams()
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=backward_override_from_env)

    _field_checks = {
        "use_power_2_scales": check_bool,
        "fp8_format": _check_fp8_format,
        "fp8_gemm_fprop": _check_mm_params,
        "fp8_gemm_dgrad": _check_mm_params,
        "fp8_gemm_wgrad": _check_mm_params,
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_backward_override,
    }

    def __repr__(self) -> str:
        # Plain values only, like DelayedScaling's.
        return (
            f"recipe_type={type(self).__name__}, "
            f"format={self.fp8_format.name}, "
            f"use_power_2_scales={self.use_power_2_scales}, "
            f"fp8_gemm_fprop={self.fp8_gemm_fprop}, "
            f"fp8_gemm_dgrad={self.fp8_gemm_dgrad}, "
            f"fp8_gemm_wgrad={self.fp8_gemm_wgrad}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}"
        )


@dataclasses.dataclass(repr=False)
class Float8BlockScaling(Recipe):
    """FP8 training with block scaling: one FP32 scale per 1x128 tile or 128x128 block.

    Each cast splits the tensor (viewed as ``[M, K]``, ``K`` the last dimension) into blocks
    and computes every block's scale from its own amax, ``fp8_max / max(amax, amax_epsilon)``
    (rounded down to a power of 2 unless ``use_f32_scales``), so one large value only coarsens
    its own block. Activations and gradients use 1x128 tiles along ``K`` (their column-wise
    copies 1x128 tiles along ``M``); weights use 128x128 blocks. Nothing is kept between steps:
    there is no amax history and no amax reduction across ranks. See ``docs/recipes.md``.

    Parameters
    ----------
    use_f32_scales : bool, default from ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``
        Keep each block's scale as computed (any FP32 value) instead of rounding it down to a
        power of 2. Defaults to True exactly when the environment variable is ``"1"`` at
        construction time.
    fp8_format : Format, default Format.E4M3
        ``Format.E4M3`` everywhere, or ``Format.HYBRID`` (E5M2 gradients).
    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim : int, default 1, 2, 1
        Block shape of activations, weights and gradients: 1 (1x128) or 2 (128x128). At most
        one of them may be 2: a GEMM of two 128x128-scaled operands is not supported.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad : MMParams, default MMParams(True)
        Must keep ``use_split_accumulator=True``.
    fp8_dpa, fp8_mha : bool, default False
        Must be False: no FP8 attention with this recipe.
    backward_override : {None, "high_precision", "dequantized"}, default from env
        As :class:`Float8CurrentScaling`'s; defaults to ``NVTE_BACKWARD_OVERRIDE``.

    Attributes
    ----------
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad : QParams
        Class attributes fixed at import: ``QParams(power_2_scale=not <env "1">,
        amax_epsilon=0.0)``. The quantizers take ``amax_epsilon`` from them; whether scales
        are powers of 2 follows the instance's ``use_f32_scales`` (upstream reads the class
        attribute, so there ``use_f32_scales=True`` without the environment variable still
        gives power-of-2 scales).

    Raises
    ------
    RecipeTypeError
        A field has the wrong type (a ``TypeError`` and a ``ValueError``).
    ValueError
        A field has an unsupported value, or two block dims are 2.
    """

    use_f32_scales: bool = dataclasses.field(default_factory=fp32_scales_from_env)
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: ClassVar[QParams] = _import_time_block_qparams()
    fp8_quant_fwd_weight: ClassVar[QParams] = _import_time_block_qparams()
    fp8_quant_bwd_grad: ClassVar[QParams] = _import_time_block_qparams()
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=backward_override_from_env)

    _field_checks = {
        "use_f32_scales": check_bool,
        "fp8_format": _check_fp8_format,
        "x_block_scaling_dim": _check_block_scaling_dim,
        "w_block_scaling_dim": _check_block_scaling_dim,
        "grad_block_scaling_dim": _check_block_scaling_dim,
        "fp8_gemm_fprop": _check_split_accumulator,
        "fp8_gemm_dgrad": _check_split_accumulator,
        "fp8_gemm_wgrad": _check_split_accumulator,
        "fp8_dpa": _check_false,
        "fp8_mha": _check_false,
        "backward_override": check_backward_override,
    }

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, dataclasses.MISSING)
        super().__setattr__(name, value)
        _check_block_dims_together(self, name, old)

    def __repr__(self) -> str:
        return (
            f"recipe_type={type(self).__name__}, "
            f"format={self.fp8_format.name}, "
            f"use_f32_scales={self.use_f32_scales}, "
            f"x_block_scaling_dim={self.x_block_scaling_dim}, "
            f"w_block_scaling_dim={self.w_block_scaling_dim}, "
            f"grad_block_scaling_dim={self.grad_block_scaling_dim}, "
            f"fp8_gemm_fprop={self.fp8_gemm_fprop}, "
            f"fp8_gemm_dgrad={self.fp8_gemm_dgrad}, "
            f"fp8_gemm_wgrad={self.fp8_gemm_wgrad}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}"
        )


@dataclasses.dataclass(repr=False)
class MXFP8BlockScaling(Recipe):
    """MXFP8 training: one E8M0 (power-of-2) scale per 32 consecutive elements.

    Row-wise copies use blocks of 32 along the last dimension, column-wise copies blocks of 32
    along the leading (flattened) dimensions; each block's scale is ``2^(e-127)`` with ``e``
    the exponent of ``amax / fp8_max`` rounded up (see ``docs/recipes.md``). Nothing is kept
    between steps: no amax history and no amax reduction across ranks. GEMMs are emulated
    (dequantize and multiply in float32) on every device: native MXFP8 GEMMs need Blackwell.

    Parameters
    ----------
    margin : int, default 0
        Kept for upstream compatibility; block scales do not use it. Must be >= 0.
    fp8_format : Format, default Format.E4M3
        ``Format.E4M3`` everywhere, or ``Format.HYBRID`` (E5M2 gradients); E5M2 is refused.
    fp8_dpa, fp8_mha : bool, default False
        Accepted, as upstream; ``DotProductAttention`` refuses to run FP8 attention (not built
        here) unless ``NVTE_DPA_FP8_RECIPE=F16`` (see ``docs/attention.md``).
    backward_override : {None, "high_precision", "dequantized"}, default from env
        As :class:`Float8CurrentScaling`'s; defaults to ``NVTE_BACKWARD_OVERRIDE``.
    enable_2d_quantization : bool, default False
        Weights use one scale per 32x32 block, shared by both copies.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=backward_override_from_env)
    enable_2d_quantization: bool = False

    _field_checks = {
        "margin": functools.partial(check_int_at_least, minimum=0),
        "fp8_format": _check_fp8_format,
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_backward_override,
        "enable_2d_quantization": check_bool,
    }

    def __repr__(self) -> str:
        return (
            f"recipe_type={type(self).__name__}, margin={self.margin}, "
            f"format={self.fp8_format.name}, fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}, "
            f"enable_2d_quantization={self.enable_2d_quantization}"
        )


@dataclasses.dataclass(repr=False)
class NVFP4BlockScaling(_NVFP4Fields, Recipe):
    """NVFP4 training: E2M1 values, one E4M3 scale per 16 elements, an FP32 tensor scale.
    RHT on the inputs' and gradients' column-wise copies, 16x16 weight blocks, stochastic
    rounding of gradients, each unless its ``disable_*`` field is set; GEMMs are emulated.
    Options not built raise ``NotImplementedError`` when used. See ``docs/recipes.md``."""


# ------------------------------------------------------------------ custom recipe


@dataclasses.dataclass(repr=False)
class CustomRecipe(Recipe):
    """A recipe whose quantizer of every slot is chosen by a factory.

    Each module or fusible operation asks ``qfactory`` for one quantizer per slot, passing the
    slot's ``QuantizerRole`` (``module_type``, ``tensor_type``, ``name``), or ``None`` for
    boundary slots (a module's output and grad-input). The factory returns either a
    ``Quantizer``, used as it is, or a ``DelayedScalingRequest``, for which the library keeps
    delayed-scaling state (amax history and scale on the owner's device, reduced and updated
    like :class:`~transformer_engine.common.recipe.DelayedScaling`'s). See ``docs/recipes.md``.

    Parameters
    ----------
    qfactory : callable
        ``qfactory(role) -> Quantizer | QuantizerRequest``; called once per slot whenever a
        module's or operation's quantization state is (re)built. Returning ``None`` is an error.
    fp8_format : Format, default Format.HYBRID
        The format reported to code that asks the recipe (e.g. ``fp8_max_fwd``); the
        quantizers' own formats are the factory's choice.
    fp8_dpa, fp8_mha : bool, default False
        (Beta) FP8 attention flags, as on the built-in recipes.
    backward_override : {None, "high_precision", "dequantized"}, default from env
        As :class:`~transformer_engine.common.recipe.Float8CurrentScaling`'s; defaults to
        ``NVTE_BACKWARD_OVERRIDE`` at construction time.
    quantization_alignment : int, default 128
        Row alignment the factory's quantized tensors need (returned by
        ``get_align_size_for_quantization`` without calling the factory). Must be positive.
    """

    qfactory: Callable[..., Any]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default_factory=backward_override_from_env)
    quantization_alignment: int = 128

    _field_checks = {
        "qfactory": check_qfactory,
        "fp8_format": _check_fp8_format,
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_backward_override,
        "quantization_alignment": check_alignment,
    }

    def __repr__(self) -> str:
        # Plain values only (the factory by name, not by address), like the other recipes.
        factory = getattr(self.qfactory, "__qualname__", type(self.qfactory).__qualname__)
        return (
            f"recipe_type={type(self).__name__}, "
            f"qfactory={factory}, "
            f"format={self.fp8_format.name}, "
            f"fp8_dpa={self.fp8_dpa}, "
            f"fp8_mha={self.fp8_mha}, "
            f"backward_override={self.backward_override}, "
            f"quantization_alignment={self.quantization_alignment}"
        )
