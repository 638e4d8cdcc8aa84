"""Quantization recipes: configuration objects that say how tensors are cast to FP8.

A recipe is pure configuration. It holds no tensors and imports neither torch nor
``transformer_engine.pytorch``; the quantization state built from it (scales, amax histories,
quantizers) lives in ``transformer_engine.pytorch``. Recipes are mutable dataclasses, as
upstream's are: they compare field by field, are not hashable, and their fields may be assigned
after construction. Every field is checked at construction and on every assignment: a bad value
raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the field, the value and
the fix. Modules and operations compare the recipe they run with against a copy of the one their
state was built from, so a recipe changed between steps refreshes that state exactly as an equal
new recipe would. ``MMParams`` and ``QParams`` are frozen (hashable), as upstream's are.

Three recipes are available:

* :class:`DelayedScaling`: per-tensor scales computed from a history of amaxes seen in earlier
  steps.
* :class:`Float8CurrentScaling`: per-tensor scales computed from the tensor being cast.
* :class:`CustomRecipe`: every quantizer chosen by a user factory, per role.

The scaling math of the first two is described in ``docs/recipes.md``.

Environment variables (each read at construction time, by one helper in this module):

``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``
    ``"1"`` makes ``Float8CurrentScaling.use_power_2_scales`` default to True; any other value,
    or unset, to False. The class-level ``Float8CurrentScaling.fp8_quant_*`` parameters read it
    once, when this module is imported.
``NVTE_BACKWARD_OVERRIDE``
    Default of ``Float8CurrentScaling.backward_override``: unset or empty means None, else
    ``"high_precision"`` or ``"dequantized"``. ``DelayedScaling`` does not read it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, NamedTuple

from ._compat_arguments import check_interval, check_override_linear_precision
from ._field_checks import (
    backward_override_from_env,
    check_amax_compute_algo,
    check_backward_override,
    check_bool,
    check_delayed_backward_override,
    check_int_at_least,
    check_optional_callable,
    power_2_scales_from_env,
    type_name,
)

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "CustomRecipe",
]


# ------------------------------------------------------------------ formats and parameters


class _FormatMaxima(NamedTuple):
    """Largest finite magnitudes of a :class:`Format`: forward tensors and gradients."""

    max_fwd: int
    max_bwd: int


class Format(Enum):
    """Low-precision number formats a recipe can cast to.

    Each member's ``value`` is a named tuple ``(max_fwd, max_bwd)``: the largest finite
    magnitude of the format used for forward tensors (activations, weights) and for backward
    tensors (gradients). Read them as ``fmt.value.max_fwd`` and ``fmt.value.max_bwd``.

    Attributes
    ----------
    E2M1
        FP4 (largest value 6) everywhere. Only for FP4 recipes; FP8 recipes reject it.
    E4M3
        FP8 E4M3 (largest value 448) everywhere.
    E5M2
        FP8 E5M2 (largest value 57344) everywhere. FP8 recipes reject it: pure E5M2 training is
        not supported.
    HYBRID
        E4M3 for forward tensors, E5M2 for gradients (448 / 57344).
    """

    E2M1 = _FormatMaxima(max_fwd=6, max_bwd=6)
    E4M3 = _FormatMaxima(max_fwd=448, max_bwd=448)
    E5M2 = _FormatMaxima(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatMaxima(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """Options of one FP8 matrix multiplication (GEMM).

    Parameters
    ----------
    use_split_accumulator : bool, default True
        Accumulate in higher precision by periodically promoting the partial sums (cuBLASLt's
        split accumulation) instead of the faster FP8 fast-accumulation mode.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)


@dataclasses.dataclass(frozen=True)
class QParams:
    """Options of one quantization role (input, weight or gradient).

    Parameters
    ----------
    power_2_scale : bool, default False
        Round each scale down to a power of 2, so scaling is exact in binary.
    amax_epsilon : float, default 0.0
        Lower bound applied to the amax before the scale is computed; keeps near-zero tensors
        from producing huge scales. Must be finite and >= 0.
    random_hadamard_transform : bool, default False
        Apply a random Hadamard transform before quantizing (FP4 recipes only).
    stochastic_rounding : bool, default False
        Round stochastically instead of to nearest (FP4 recipes only).
    fp4_2d_quantization : bool, default False
        Use 2D blocks for FP4 quantization (FP4 recipes only).
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        for name in (
            "power_2_scale",
            "random_hadamard_transform",
            "stochastic_rounding",
            "fp4_2d_quantization",
        ):
            check_bool("QParams", name, getattr(self, name))
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise TypeError(
                f"QParams: amax_epsilon must be a float, got {eps!r} ({type_name(eps)}); "
                f"pass a finite number >= 0.0"
            )
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(
                f"QParams: amax_epsilon must be finite and >= 0.0, got {eps!r}; pass e.g. 0.0"
            )
        # Normalise ints (and numpy scalars) so equal epsilons compare and print alike.
        object.__setattr__(self, "amax_epsilon", float(eps))


def _check_fp8_format(owner: str, name: str, value: Any) -> Format:
    if not isinstance(value, Format):
        raise TypeError(
            f"{owner}: {name} must be a Format, got {value!r} ({type_name(value)}); "
            f"pass Format.HYBRID or Format.E4M3"
        )
    if value is Format.E5M2:
        raise ValueError(
            f"{owner}: {name}=Format.E5M2: pure E5M2 training is not supported; use "
            f"Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3"
        )
    if value is Format.E2M1:
        raise ValueError(
            f"{owner}: {name}=Format.E2M1 is an FP4 format, not an FP8 one; use "
            f"Format.HYBRID or Format.E4M3"
        )
    return value


def _check_mm_params(owner: str, name: str, value: Any) -> MMParams:
    if not isinstance(value, MMParams):
        raise TypeError(
            f"{owner}: {name} must be an MMParams, got {value!r} ({type_name(value)}); "
            f"pass e.g. MMParams(use_split_accumulator=True)"
        )
    return value


def _import_time_role_qparams() -> QParams:
    """Per-role ``QParams`` of ``Float8CurrentScaling``, made once when this module is imported."""
    return QParams(power_2_scale=power_2_scales_from_env(), amax_epsilon=0.0)


# ------------------------------------------------------------------ recipes


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


class Recipe:
    """Base class of every quantization recipe.

    The predicates below test the recipe's class; they are classmethods, so they work on a
    class (``DelayedScaling.delayed()``) and on an instance (``recipe.delayed()``) alike.
    Predicates for recipe families this project does not implement return False.

    Recipes are mutable, as upstream's are: code assigns fields of a recipe it already built
    (``recipe.amax_history_len = 16``). Every assignment, including the constructor's own, is
    checked by the same per-field check, so a bad value raises at the line that assigned it,
    naming the field and the value, instead of reaching the kernels. (Upstream does not check
    assignments at all; checking at autocast entry instead would report the mistake far from
    where it was made, and nothing upstream assigns is refused: its recipe checks are each about
    one field.) Assigning a name that is not a field raises ``AttributeError``: a misspelt
    field would otherwise be silently ignored.
    """

    # Per-field checks of a subclass: ``{field name: check(owner, name, value) -> value}``.
    _field_checks: ClassVar[dict[str, Callable[[str, str, Any], Any]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        if dataclasses.is_dataclass(cls):
            if name not in _field_names(cls):
                raise AttributeError(_not_a_field_message(cls, name))
            check = cls._field_checks.get(name)
            if check is not None:
                value = check(cls.__name__, name, value)
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
        """Whether this is an NVFP4 block-scaling recipe (not implemented here: always False)."""
        return False

    @classmethod
    def mxfp8(cls) -> bool:
        """Whether this is an MXFP8 block-scaling recipe (not implemented here: always False)."""
        return False

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
        """Whether this is an FP8 block-scaling recipe (not implemented here: always False)."""
        return False

    @classmethod
    def custom(cls) -> bool:
        """Whether this is a :class:`CustomRecipe` (quantizers chosen by a user factory)."""
        return issubclass(cls, CustomRecipe)


def _not_a_field_message(cls: type, name: str) -> str:
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    if hasattr(cls, name):
        return (
            f"{cls.__name__}.{name} is a class attribute shared by every {cls.__name__}, not a "
            f"field of one recipe, and cannot be assigned on an instance; the fields are: "
            f"{fields}"
        )
    return f"{cls.__name__} has no field {name!r}; its fields are: {fields}"


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
    before ``k``. See ``docs/recipes.md`` for the exact rules.

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
    TypeError
        A field has the wrong type, or an unknown keyword argument was given.
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
    keep between steps. See ``docs/recipes.md`` for the exact rules.

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
        amax_epsilon=0.0)``, fixed when this module is imported. Passing them to the
        constructor is a ``TypeError``; assigning them on an instance an ``AttributeError``.

    Raises
    ------
    TypeError
        A field has the wrong type, or an unknown keyword argument was given.
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


# ------------------------------------------------------------------ custom recipe


def _check_qfactory(owner: str, name: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        raise TypeError(
            f"{owner}: {name} must be a callable taking a QuantizerRole (or None) and returning "
            f"a Quantizer or a QuantizerRequest, got {value!r} ({type_name(value)}); pass e.g. "
            f"transformer_engine.pytorch.custom_recipes.quantizer_factories.current_scaling_factory"
        )
    return value


def _check_alignment(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an int, got {value!r} ({type_name(value)}); pass a "
            f"positive integer such as 128"
        )
    if value <= 0:
        raise ValueError(
            f"{owner}: {name} must be positive, got {value}; pass a positive integer such as 128"
        )
    return int(value)


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
        "qfactory": _check_qfactory,
        "fp8_format": _check_fp8_format,
        "fp8_dpa": check_bool,
        "fp8_mha": check_bool,
        "backward_override": check_backward_override,
        "quantization_alignment": _check_alignment,
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
