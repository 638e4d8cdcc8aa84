"""Per-module, per-direction quantization state built from a recipe.

A recipe state owns the tensors its quantizers read and write (delayed scaling: ``scale [N]``
and ``amax_history [L, N]``). It always lives on one concrete device, the device of the module
or op that owns it (see docs/architecture.md): there is no ambient default, so ``device`` must be
given and must be a real device (``meta`` modules create their state after materialization).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from ..constants import DType, TE_DType
from ..quantized_tensor import Quantizer
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer
from .quantizer_roles import DelayedScalingRequest, QuantizerRequest, QuantizerRole

__all__ = [
    "RecipeState",
    "DelayedScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "Float8BlockScalingRecipeState",
    "MXFP8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState",
    "CustomRecipeState",
    "get_fp8_torch_dtype",
    "get_fp8_te_dtype",
    "get_fp4_te_dtype",
    "get_fp8_max",
]

_MODES = ("forward", "backward")


def get_fp8_torch_dtype(recipe, fprop_tensor: bool = True) -> torch.dtype:
    """E4M3 for E4M3 recipes and for forward tensors of HYBRID recipes, else E5M2."""
    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and fprop_tensor):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def get_fp8_te_dtype(recipe, fprop_tensor: bool = True):
    """The ``DType`` counterpart of :func:`get_fp8_torch_dtype`."""
    return TE_DType[get_fp8_torch_dtype(recipe, fprop_tensor)]


def get_fp4_te_dtype(recipe):
    """The ``DType`` of an FP4 recipe's values: ``kFloat4E2M1`` (its only FP4 format)."""
    fmt = getattr(recipe, "fp4_format", None)
    if fmt != Format.E2M1:
        raise ValueError(
            f"get_fp4_te_dtype: {type(recipe).__name__} has no FP4 format E2M1 (fp4_format="
            f"{fmt!r}); pass an NVFP4BlockScaling recipe"
        )
    return DType.kFloat4E2M1


def get_fp8_max(recipe, fprop_tensor: bool = True) -> float:
    """Largest finite value of the format a tensor of this direction uses (448 or 57344)."""
    fmt = recipe.fp8_format.value
    return fmt.max_fwd if fprop_tensor else fmt.max_bwd


def _concrete_device(device: Any) -> torch.device:
    if device is None:
        raise ValueError(
            "RecipeState.create needs device=...: pass the device of the module's parameters "
            "(recipe state is never placed on an ambient default device)"
        )
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "RecipeState cannot live on the meta device; create it after the module's "
            "parameters are materialized, on their device"
        )
    if device.type == "cuda" and device.index is None:
        raise ValueError(
            f"device={device} names no CUDA index; pass e.g. weight.device (cuda:N) so the "
            "state lands next to the weights"
        )
    return device


class RecipeState:
    """Quantization state of one direction (``mode``) of one module, on one device."""

    mode: str
    num_quantizers: int
    device: torch.device
    recipe: Any

    @staticmethod
    def create(recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None):
        """Build the state class that matches ``recipe`` (delayed or current scaling)."""
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r} must be 'forward' or 'backward'")
        if not isinstance(num_quantizers, int) or num_quantizers < 0:
            raise ValueError(f"num_quantizers={num_quantizers!r} must be an int >= 0")
        if isinstance(recipe, DelayedScaling):
            cls = DelayedScalingRecipeState
        elif isinstance(recipe, Float8CurrentScaling):
            cls = Float8CurrentScalingRecipeState
        elif isinstance(recipe, Float8BlockScaling):
            cls = Float8BlockScalingRecipeState
        elif isinstance(recipe, MXFP8BlockScaling):
            cls = MXFP8BlockScalingRecipeState
        elif isinstance(recipe, NVFP4BlockScaling):
            cls = NVFP4BlockScalingRecipeState
        elif isinstance(recipe, CustomRecipe):
            cls = CustomRecipeState
        else:
            raise NotImplementedError(
                f"recipe {type(recipe).__name__} is not implemented; use DelayedScaling, "
                "Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling or "
                "CustomRecipe"
            )
        # Never inference tensors, whatever mode the first forward runs in (a validation pass
        # under torch.inference_mode before training): the state is updated in place later.
        with torch.inference_mode(False):
            return cls(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)

    def make_quantizers(self) -> list:
        raise NotImplementedError

    def inherit_state_from(self, other: RecipeState) -> None:
        """Take over compatible persistent tensors of ``other`` (stateless recipes: none)."""

    def delayed_scaling_state(self) -> DelayedScalingRecipeState | None:
        """The delayed-scaling part of this state: the tensors the amax registry reduces and
        updates, the recompute swaps and checkpoints save (``None``: nothing persistent)."""
        return None


class DelayedScalingRecipeState(RecipeState):
    """``scale [N]`` (starts at 1) and ``amax_history [L, N]`` (starts at 0) on ``device``.

    Quantizers made by :meth:`make_quantizers` hold *views* into these tensors, so casts
    accumulate amaxes straight into history row 0 and read the current scale.
    """

    _persistent_state_buffers = ("scale", "amax_history")

    def __init__(self, recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None):
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.device = _concrete_device(device)
        self.dtype = get_fp8_te_dtype(recipe, mode == "forward")
        self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=self.device)
        self.amax_history = torch.zeros(
            recipe.amax_history_len, num_quantizers, dtype=torch.float32, device=self.device
        )

    def make_quantizers(self) -> list:
        return [
            Float8Quantizer(
                scale=self.scale[i],
                amax=self.amax_history[0][i].reshape((1,)),
                fp8_dtype=self.dtype,
            )
            for i in range(self.num_quantizers)
        ]

    def delayed_scaling_state(self) -> DelayedScalingRecipeState:
        return self

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the scales and amax history (activation recompute casts with them later)."""
        return self.scale.clone(), self.amax_history.clone()

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write a :meth:`snapshot` back into this state's own tensors, in place."""
        with torch.no_grad():
            self.scale.copy_(snapshot[0])
            self.amax_history.copy_(snapshot[1])

    def inherit_state_from(self, other: RecipeState) -> None:
        """Take over ``other``'s scale and history when they are compatible.

        Tensors on this state's device are rebound (so registry entries and quantizers that
        alias them stay valid); tensors on any other device are *copied* here instead, so a
        state never ends up holding tensors of another device.
        """
        if not isinstance(other, DelayedScalingRecipeState):
            return
        if (
            self.scale.shape == other.scale.shape
            and self.amax_history.shape[1:] == other.amax_history.shape[1:]
            and self.amax_history.shape[0] != other.amax_history.shape[0]
        ):
            # Only amax_history_len changed: upstream keeps the scales and adjusts the history
            # length (first rows kept, zero-padded) instead of starting over from scale 1.
            rows = min(self.amax_history.shape[0], other.amax_history.shape[0])
            with torch.no_grad():
                self.scale.copy_(other.scale)
                self.amax_history[:rows].copy_(other.amax_history[:rows])
            return
        for name in self._persistent_state_buffers:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                return
        for name in self._persistent_state_buffers:
            theirs = getattr(other, name)
            if theirs.device == self.device:
                setattr(self, name, theirs)
            else:
                getattr(self, name).copy_(theirs)

    def adjust_amax_history_length(self, length: int) -> None:
        """Truncate (keeping the first rows) or zero-pad the history to ``length`` rows."""
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"amax_history_len={length!r} must be an int >= 1")
        current = self.amax_history.shape[0]
        with torch.inference_mode(False):
            self._resize_history(length, current)

    def _resize_history(self, length: int, current: int) -> None:
        if length < current:
            self.amax_history = self.amax_history[:length].clone()
        elif length > current:
            pad = torch.zeros(
                length - current, self.num_quantizers, dtype=torch.float32, device=self.device
            )
            self.amax_history = torch.cat([self.amax_history, pad], dim=0)


class Float8CurrentScalingRecipeState(RecipeState):
    """Current scaling keeps no tensors between steps; it only configures its quantizers."""

    def __init__(self, recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None):
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.device = _concrete_device(device)
        self.dtype = get_fp8_te_dtype(recipe, mode == "forward")

    def make_quantizers(self) -> list:
        qparams = self.recipe.fp8_quant_fwd_inp if self.mode == "forward" else None
        if qparams is None:
            qparams = self.recipe.fp8_quant_bwd_grad
        return [
            Float8CurrentScalingQuantizer(
                self.dtype,
                force_pow_2_scales=self.recipe.use_power_2_scales,
                amax_epsilon=qparams.amax_epsilon,
            )
            for _ in range(self.num_quantizers)
        ]


class Float8BlockScalingRecipeState(RecipeState):
    """Block scaling keeps no tensors between steps (no amax history, nothing to reduce across
    ranks); it only configures its quantizers.

    Every slot gets a :class:`Float8BlockQuantizer` with both usages. Forward weight slots
    (role ``tensor_type == "weight"``; without roles, upstream's positional rule: slot
    ``i % 3 == 1``) use ``w_block_scaling_dim`` and the weight ``QParams``; other forward slots
    ``x_block_scaling_dim`` and the input ``QParams``; backward slots
    ``grad_block_scaling_dim``, the gradient ``QParams`` and E5M2 under ``Format.HYBRID``.
    Scales are powers of 2 unless the recipe's ``use_f32_scales`` is set.
    """

    def __init__(self, recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None):
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.device = _concrete_device(device)
        self.dtype = get_fp8_te_dtype(recipe, mode == "forward")

    def _is_weight_slot(self, index: int) -> bool:
        if self.mode != "forward":
            return False
        if self.roles is not None:
            role = self.roles[index]
            return role is not None and role.tensor_type == "weight"
        return index % 3 == 1

    def make_quantizers(self) -> list:
        recipe = self.recipe
        quantizers = []
        for i in range(self.num_quantizers):
            if self.mode == "backward":
                dim, qparams = recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad
            elif self._is_weight_slot(i):
                dim, qparams = recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight
            else:
                dim, qparams = recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp
            quantizers.append(
                Float8BlockQuantizer(
                    self.dtype,
                    rowwise=True,
                    columnwise=True,
                    amax_epsilon=qparams.amax_epsilon,
                    force_pow_2_scales=not recipe.use_f32_scales,
                    block_scaling_dim=dim,
                )
            )
        return quantizers


class MXFP8BlockScalingRecipeState(Float8BlockScalingRecipeState):
    """MXFP8 keeps no tensors between steps either. Every slot gets an :class:`MXFP8Quantizer`
    with both usages (E5M2 for backward slots under ``Format.HYBRID``); forward weight slots
    use 32x32 blocks when the recipe's ``enable_2d_quantization`` is set."""

    def make_quantizers(self) -> list:
        two_d = self.recipe.enable_2d_quantization
        return [
            MXFP8Quantizer(
                self.dtype,
                rowwise=True,
                columnwise=True,
                with_2d_quantization=two_d and self._is_weight_slot(i),
            )  # fmt: skip
            for i in range(self.num_quantizers)
        ]


class NVFP4BlockScalingRecipeState(Float8BlockScalingRecipeState):
    """NVFP4 keeps no tensors between steps. Every slot gets an :class:`NVFP4Quantizer` with
    both usages, configured from the recipe's QParams: backward slots from
    ``fp4_quant_bwd_grad``, forward weight slots from ``fp4_quant_fwd_weight``, other forward
    slots from ``fp4_quant_fwd_inp`` (RHT with post-RHT amax, stochastic rounding and 2-D
    blocks as each asks)."""

    def make_quantizers(self) -> list:
        recipe = self.recipe
        quantizers = []
        for i in range(self.num_quantizers):
            if self.mode == "backward":
                qparams = recipe.fp4_quant_bwd_grad
            elif self._is_weight_slot(i):
                qparams = recipe.fp4_quant_fwd_weight
            else:
                qparams = recipe.fp4_quant_fwd_inp
            quantizers.append(
                NVFP4Quantizer(
                    rowwise=True,
                    columnwise=True,
                    with_rht=qparams.random_hadamard_transform,
                    with_post_rht_amax=qparams.random_hadamard_transform,
                    with_2d_quantization=qparams.fp4_2d_quantization,
                    stochastic_rounding=qparams.stochastic_rounding,
                )
            )
        return quantizers


class CustomRecipeState(RecipeState):
    """The state of a :class:`~transformer_engine.common.recipe.CustomRecipe`: one factory
    answer per slot.

    The factory is called once per slot, with the slot's :class:`QuantizerRole` (``None`` for a
    boundary slot). A returned ``Quantizer`` is used as it is. Slots answered with a
    :class:`DelayedScalingRequest` (all requests must be equal) share one inner
    :class:`DelayedScalingRecipeState` sized for every slot, on ``device``: its quantizers view
    it, and the owner registers it with the amax registry like a ``DelayedScaling`` state, with
    the ``DelayedScaling`` recipe the request describes (so it is reduced and updated by those
    rules; unused columns keep a zero amax, which leaves their scale unchanged).
    """

    def __init__(self, recipe, *, mode: str, num_quantizers: int = 1, device=None, roles=None):
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.device = _concrete_device(device)
        self.roles = self._check_roles(roles, num_quantizers)
        self.answers = [self._ask_factory(role) for role in self.roles]
        requests = {a for a in self.answers if isinstance(a, DelayedScalingRequest)}
        if len(requests) > 1:
            raise ValueError(
                f"CustomRecipe: the factory returned different DelayedScalingRequests within one "
                f"{mode} state ({sorted(map(repr, requests))}); they share one amax history and "
                "scale, so return one equal request for every delayed-scaling slot"
            )
        self.delayed_state = None
        if requests:
            self.delayed_state = DelayedScalingRecipeState(
                requests.pop().as_delayed_scaling(),
                mode=mode,
                num_quantizers=num_quantizers,
                device=self.device,
            )

    @staticmethod
    def _check_roles(roles, num_quantizers: int) -> list:
        if roles is None:
            warnings.warn(
                "CustomRecipe: the module or operation declares no quantizer roles; every slot "
                "is asked for with QuantizerRole()",
                stacklevel=3,
            )
            return [QuantizerRole()] * num_quantizers
        roles = list(roles)
        if len(roles) != num_quantizers:
            raise ValueError(
                f"CustomRecipe: {len(roles)} quantizer roles were given for {num_quantizers} "
                "slots; give one role (or None for a boundary slot) per slot"
            )
        for role in roles:
            if role is not None and not isinstance(role, QuantizerRole):
                raise TypeError(
                    f"CustomRecipe: quantizer role {role!r} ({type(role).__name__}) is not a "
                    "QuantizerRole or None"
                )
        return roles

    def _ask_factory(self, role):
        answer = self.recipe.qfactory(role)
        if answer is None:
            raise ValueError(
                f"CustomRecipe: qfactory returned None for role {role}; return a Quantizer or a "
                "DelayedScalingRequest for every role, including None (boundary) roles"
            )
        if isinstance(answer, DelayedScalingRequest) or isinstance(answer, Quantizer):
            return answer
        if isinstance(answer, QuantizerRequest):
            raise NotImplementedError(
                f"CustomRecipe: qfactory returned {type(answer).__name__} for role {role}; the "
                "only request implemented is DelayedScalingRequest"
            )
        raise TypeError(
            f"CustomRecipe: qfactory returned {answer!r} ({type(answer).__name__}) for role "
            f"{role}; return a Quantizer or a DelayedScalingRequest"
        )

    def make_quantizers(self) -> list:
        delayed = self.delayed_state.make_quantizers() if self.delayed_state else None
        return [
            delayed[i] if isinstance(answer, DelayedScalingRequest) else answer
            for i, answer in enumerate(self.answers)
        ]

    def delayed_scaling_state(self) -> DelayedScalingRecipeState | None:
        return self.delayed_state

    def inherit_state_from(self, other: RecipeState) -> None:
        """Take over ``other``'s delayed-scaling tensors when both have them and their dtype,
        slot count and history length match."""
        mine, theirs = self.delayed_state, other.delayed_scaling_state()
        if mine is not None and theirs is not None and mine.dtype == theirs.dtype:
            mine.inherit_state_from(theirs)
