"""The operation classes of the fusible-ops API: ``FusibleOperation``, ``BasicOperation`` and
``FusedOperation``.

A *basic operation* owns parameters and quantization state and knows how to run its forward
(``op_forward``) and backward (``op_backward``). A *fused operation* runs several consecutive
basic operations at once; it holds no state of its own, only references to the basic operations
it fuses. An ``OperationFuser`` (``fuser.py``) runs a list of them as one autograd function.

Rules this file implements (docs/architecture.md, the device contract):

* quantization (recipe) state is owned by the basic operation and created on the device of its
  own parameters, after they exist; a parameterless operation uses the device of its input;
* parameters built on ``meta`` hold no storage until ``reset_parameters()`` (or the first
  forward, through the fuser) materializes them; nothing here caches a ``Parameter`` object.
"""

from __future__ import annotations

import abc
import copy
from typing import Any

import torch

# Re-exported so that existing imports of ops.op.materialization_device keep working.
from ..device import materialization_device
from ..quantization import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    FP8GlobalStateManager,
    RecipeState,
)
from ._op_extra_state import get_op_extra_state, set_op_extra_state
from .fuser import OperationFuser
from .operation_context import OperationContext

__all__ = [
    "OperationContext",
    "FusibleOperation",
    "BasicOperation",
    "FusedOperation",
    "materialization_device",
]

_MODES = ("forward", "backward")


class FusibleOperation(torch.nn.Module, abc.ABC):
    """Base of every operation an ``OperationFuser`` can run.

    Subclasses implement :meth:`fuser_forward` and :meth:`fuser_backward`, which work on the
    contexts of the basic operations they cover, so that the forward and the backward of a
    sequence of operations can be fused differently.
    """

    @property
    @abc.abstractmethod
    def is_fused_op(self) -> bool:
        """Whether this operation stands for several basic operations."""

    def pre_first_fuser_forward(self) -> None:
        """Hook run once, before the first forward of a fuser, after materialization."""

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        """Hook run before every fuser forward; ``requires_grad``: whether backward will run."""

    def get_input_quantizer(self):
        """Quantizer for this operation's input (``None`` if it has none)."""
        return None

    def get_grad_output_quantizer(self):
        """Quantizer for the gradient of this operation's output (``None`` if it has none)."""
        return None

    def reset_parameters(self, device=None) -> None:
        """(Re)initialize the parameters, materializing meta ones (on ``device`` if given)."""

    @abc.abstractmethod
    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[torch.Tensor, ...]],
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs: list[dict[str, Any]],
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Forward of the covered basic operations.

        Returns
        -------
        output : torch.Tensor
        extra_outputs : list of tuple of torch.Tensor
            One tuple per covered basic operation.
        """

    @abc.abstractmethod
    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor | None, list[list], list[tuple]]:
        """Backward of the covered basic operations.

        Returns
        -------
        grad_input : torch.Tensor or None
        grad_params : list of list
            Per covered basic operation, the gradients of its parameters in the order of
            ``op.parameters()`` (``None`` entries allowed).
        grad_extra_inputs : list of tuple
            Per covered basic operation, the gradients of its extra inputs.
        """


class BasicOperation(FusibleOperation):
    """An operation with its own parameters and quantization state.

    Subclasses implement :meth:`op_forward` and :meth:`op_backward`, and declare their
    quantizers with :meth:`num_quantizers`. Operations with extra inputs or outputs
    (``num_extra_inputs`` / ``num_extra_outputs``) override the fuser methods instead.

    Recipe state (one ``RecipeState`` per direction with quantizers) lives in ``_fp8_metas``
    and is made by :meth:`reset_recipe_state` on the device of the operation's parameters.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def __init__(self) -> None:
        super().__init__()
        # {"forward": {"scaling_fwd": state, "recipe": ..., "fp8_group": ...} | None, ...}
        self._fp8_metas: dict[str, dict | None] | None = None
        # {"forward": [quantizer, ...], "backward": [...]}, None while FP8 is off
        self._quantizers: dict[str, list] | None = None

    @property
    def is_fused_op(self) -> bool:
        return False

    # -- parameters ------------------------------------------------------------------------------
    def own_parameters(self) -> list[torch.nn.Parameter]:
        """``list(self.parameters())``, read afresh on every call (parameters may be replaced
        between calls): the fuser asks several times per forward, so an operation without
        submodules reads its own parameter dict directly instead of through the
        ``named_parameters`` generators (same order, duplicates dropped the same way)."""
        if self._modules:
            return list(self.parameters())
        params = [p for p in self._parameters.values() if p is not None]
        if len(params) > 1 and len({id(p) for p in params}) != len(params):
            unique: dict[int, torch.nn.Parameter] = {}
            for p in params:
                unique.setdefault(id(p), p)  # first registration wins, as in parameters()
            params = list(unique.values())
        return params

    def parameters_device(self) -> torch.device | None:
        """Device of the operation's own parameters (``None`` when it has none)."""
        for p in self._parameters.values():  # parameters(recurse=False), without generators
            if p is not None:
                return p.device
        return None

    def has_meta_parameters(self) -> bool:
        """Whether any parameter still lives on ``meta`` (holds no storage)."""
        return any(p is not None and p.is_meta for p in self._parameters.values())

    # -- quantizers ------------------------------------------------------------------------------
    def num_quantizers(self, mode: str) -> int:
        """How many quantizers the operation uses in ``mode`` (``"forward"``/``"backward"``)."""
        return 0

    def get_quantizer_roles(self, mode: str) -> list | None:
        """The :class:`QuantizerRole` (or ``None``) of each quantizer of ``mode``; ``None``: the
        operation declares none. Only a ``CustomRecipe`` factory reads them."""
        return None

    def get_quantizer(self, mode: str, index: int):
        """Quantizer ``index`` of ``mode``; ``None`` while there is no recipe state (no FP8)."""
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r} must be 'forward' or 'backward'")
        if self._quantizers is None:
            return None
        quantizers = self._quantizers[mode]
        if not 0 <= index < len(quantizers):
            raise IndexError(
                f"{type(self).__name__} has {len(quantizers)} {mode} quantizers; index {index} "
                "is out of range"
            )
        return quantizers[index]

    def get_input_quantizer(self):
        if self.num_quantizers("forward") > 0:
            return self.get_quantizer("forward", 0)
        return None

    def get_grad_output_quantizer(self):
        if self.num_quantizers("backward") > 0:
            return self.get_quantizer("backward", 0)
        return None

    def recipe_state(self, mode: str) -> RecipeState | None:
        """The recipe state of ``mode`` (``None`` when there is none)."""
        meta = (self._fp8_metas or {}).get(mode)
        if meta is None:
            return None
        return meta[FP8GlobalStateManager.get_meta_tensor_key(mode == "forward")]

    def _recipe_state_device(self, device) -> torch.device:
        params_device = self.parameters_device()
        if params_device is not None and params_device.type != "meta":
            return params_device
        if device is None:  # the fuser's hint (_reset_recipe_state_on)
            device = self.__dict__.get("_recipe_device_hint")
        if device is None:
            raise ValueError(
                f"{type(self).__name__} has no materialized parameters to place its recipe "
                "state next to; pass device=... (the fuser passes the input's device)"
            )
        return torch.device(device)

    def _reset_recipe_state_on(self, recipe, device) -> None:
        """``self.reset_recipe_state(recipe=recipe)`` with ``device`` (the input's) as where the
        state goes while the operation has no materialized parameters. Upstream's signature is
        ``(*, recipe)``, which a user's operation may override as it is: the device travels as
        an attribute that :meth:`reset_recipe_state` reads when it gets no ``device``."""
        self.__dict__["_recipe_device_hint"] = device
        self.reset_recipe_state(recipe=recipe)

    def reset_recipe_state(self, *, recipe, device=None) -> None:
        """Make the quantization state match ``recipe``.

        Parameters
        ----------
        recipe : Recipe or None
            ``None`` (FP8 off) deactivates the quantizers; the state itself is kept so that a
            later FP8 forward with the same recipe continues its delayed-scaling history.
        device : torch.device, optional
            Where the state goes when the operation has no materialized parameters (the input's
            device); otherwise the state always lives on the parameters' device.

        Notes
        -----
        State is rebuilt when there is none, when the recipe changed, or when it is on another
        device than the parameters (after ``module.to(...)``); a rebuilt delayed-scaling state
        takes over the old scales and histories (copied across devices, resized to a new
        ``amax_history_len``). Cheap when nothing changed: called before every fuser forward.
        """
        if recipe is None:
            if self._quantizers is not None:
                self._quantizers = None
                self._on_recipe_state_change()
            return
        counts = {mode: self.num_quantizers(mode) for mode in _MODES}
        if not any(counts.values()):
            return
        target = self._recipe_state_device(device)
        metas = self._fp8_metas if self._fp8_metas is not None else dict.fromkeys(_MODES)
        rebuilt = self._quantizers is None
        snapshot = None
        for mode in _MODES:
            count = counts[mode]
            meta = metas.get(mode)
            if count == 0:
                if meta is not None:
                    _unregister(meta)
                metas[mode] = None
                continue
            key = FP8GlobalStateManager.get_meta_tensor_key(mode == "forward")
            meta = meta if meta is not None else {}
            old = meta.get(key)
            if not _state_matches(old, recipe, target, count):
                # States keep a copy of the recipe (recipes are mutable): a recipe whose fields
                # were assigned since no longer matches and rebuilds, as an equal new one would.
                snapshot = snapshot if snapshot is not None else copy.copy(recipe)
                meta[key] = self._make_state(snapshot, mode, count, target, old)
                if old is not None and meta[key].delayed_scaling_state() is None:
                    _unregister(meta)
                rebuilt = True
            # the registry keys its groups by this copy, which nobody mutates
            meta["recipe"] = meta[key].recipe
            meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
            metas[mode] = meta
        self._fp8_metas = metas
        if rebuilt:
            self._quantizers = {
                mode: (self.recipe_state(mode).make_quantizers() if counts[mode] else [])
                for mode in _MODES
            }
            self._on_recipe_state_change()

    def _make_state(self, recipe, mode, count, device, old):
        state = RecipeState.create(
            recipe,
            mode=mode,
            num_quantizers=count,
            device=device,
            roles=self.get_quantizer_roles(mode),
        )
        if type(old) is type(state) and isinstance(state, DelayedScalingRecipeState):
            if old.amax_history.shape[0] != state.amax_history.shape[0]:
                old.adjust_amax_history_length(state.amax_history.shape[0])
            state.inherit_state_from(old)
        elif isinstance(old, CustomRecipeState) and isinstance(state, CustomRecipeState):
            state.inherit_state_from(old)  # the delayed part, when dtype, count, length match
        return state

    def _on_recipe_state_change(self) -> None:
        """Hook: quantizers were (re)made or deactivated (e.g. rebind an FP8 weight)."""

    def register_recipe_state(self) -> None:
        """Put the delayed-scaling state into the amax registry (idempotent; re-points moved
        or rebuilt tensors). The fuser calls it after a successful FP8 forward."""
        registry = FP8GlobalStateManager.quantization_state.amax_registry
        for mode in _MODES:
            state = self.recipe_state(mode)
            if state is not None and state.delayed_scaling_state() is not None:
                meta = self._fp8_metas[mode]
                # the registry holding the positions, for inspection: the token that
                # add_fp8_tensors_to_global_buffer keeps decides whether to register anew
                meta["_registry"] = registry
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)

    def __getstate__(self):
        # The amax registry is process-wide, not the operation's: its reference and this
        # operation's positions in it are left out of a pickle (torch.save of the whole
        # module failed on the registry's weak references after a delayed-scaling forward)
        # and of a deep copy (which copied the whole registry). The next FP8 forward of the
        # restored or copied operation registers its own state, as register_recipe_state does
        # for a state the registry does not know.
        state = self.__dict__.copy()
        metas = state.get("_fp8_metas")
        if metas:
            dropped = ("_registry", FP8GlobalStateManager.get_buffer_info())
            state["_fp8_metas"] = {
                mode: None if meta is None else {k: v for k, v in meta.items() if k not in dropped}
                for mode, meta in metas.items()
            }
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        # A deep copy's (or an unpickled operation's) FP8 weights re-quantize with its own
        # quantizers, not (deepcopy shares a quantized tensor's quantizer) the original's.
        if self.__dict__.get("_quantizers") is not None:
            self._on_recipe_state_change()

    def __copy__(self):
        # a shallow copy shares the recipe state and its registration, as before
        # __getstate__ existed (separate metas would register the same tensors twice)
        new = type(self).__new__(type(self))
        new.__setstate__(self.__dict__.copy())
        return new

    # -- checkpoints ---------------------------------------------------------------------------
    def get_extra_state(self):
        """Delayed-scaling scales and histories as a ``torch.uint8`` tensor of bytes (no
        pickle; an empty tensor without such state)."""
        return get_op_extra_state(self)

    def set_extra_state(self, state) -> None:
        """Restore :meth:`get_extra_state`'s output onto the operation's device."""
        set_op_extra_state(self, state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args, **kwargs):
        # FP8 weights are re-quantized with the checkpoint's scales: load those first.
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if key in state_dict:
            self.set_extra_state(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args, **kwargs)

    # -- forward and backward --------------------------------------------------------------------
    @abc.abstractmethod
    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
        **kwargs,
    ) -> torch.Tensor:
        """Forward of this operation alone; saves what the backward needs into ``ctx``."""

    @abc.abstractmethod
    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        """Backward: ``(grad_input, grad_params)`` with ``grad_params`` in the order of
        ``self.parameters()``."""

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        if self.num_extra_inputs or self.num_extra_outputs:
            raise RuntimeError(
                f"{type(self).__name__} has extra inputs or outputs and must implement "
                "fuser_forward and fuser_backward itself"
            )
        output = self.op_forward(
            basic_op_ctxs[0],
            input_,
            prev_op_grad_output_quantizer=prev_op_grad_output_quantizer,
            next_op_input_quantizer=next_op_input_quantizer,
            **basic_op_kwargs[0],
        )
        return output, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        grad_input, grad_params = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [list(grad_params)], [()]

    def release_saved(self, ctx: OperationContext) -> None:
        """Hook run by the fuser after each backward: drop the references to saved tensors
        that this operation put back into ``ctx`` itself (outside ``ctx.saved_tensors``), so
        that they are freed with autograd's copies instead of living as long as the graph
        (the output). A second backward (``retain_graph=True``) must find ``ctx`` as the
        forward left it."""

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor, **kwargs):  # noqa: D102
        return OperationFuser([self])(input, *extra_inputs, basic_op_kwargs=[kwargs])


def _state_matches(state, recipe, device: torch.device, count: int) -> bool:
    if state is None or state.device != device or state.num_quantizers != count:
        return False
    return state.recipe == recipe


def _unregister(meta: dict) -> None:
    """Retire a state's registry positions (its owner no longer uses delayed scaling)."""
    meta.pop("_registry", None)
    FP8GlobalStateManager.remove_fp8_tensors_from_global_buffer(meta)


class FusedOperation(FusibleOperation):
    """Several consecutive basic operations run as one.

    Parameters
    ----------
    basic_ops : sequence of BasicOperation
        The operations covered, in forward order (stored as the ``ModuleList`` ``basic_ops``).

    The default :meth:`fuser_forward` / :meth:`fuser_backward` run the basic operations one
    after the other; fusions override them. A fused operation holds no parameters of its own:
    everything resolves to its basic operations at call time.
    """

    def __init__(self, basic_ops) -> None:
        super().__init__()
        basic_ops = list(basic_ops)
        if not basic_ops:
            raise ValueError(f"{type(self).__name__} needs at least one basic operation")
        for op in basic_ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(
                    f"{type(self).__name__} fuses basic operations, got {type(op).__name__}"
                )
        self.basic_ops = torch.nn.ModuleList(basic_ops)

    @property
    def is_fused_op(self) -> bool:
        return True

    def get_input_quantizer(self):
        return self.basic_ops[0].get_input_quantizer()

    def get_grad_output_quantizer(self):
        return self.basic_ops[-1].get_grad_output_quantizer()

    def pre_first_fuser_forward(self) -> None:
        for op in self.basic_ops:
            op.pre_first_fuser_forward()

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        for op in self.basic_ops:
            op.pre_fuser_forward(requires_grad=requires_grad)

    def reset_parameters(self, device=None) -> None:
        """(Re)initialize every basic operation's parameters (see their ``reset_parameters``)."""
        for op in self.basic_ops:
            op.reset_parameters(device=device)

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        ops = self.basic_ops
        x, extra_outputs = input_, []
        for i, op in enumerate(ops):
            prev_q = (
                prev_op_grad_output_quantizer if i == 0 else ops[i - 1].get_grad_output_quantizer()
            )
            next_q = (
                next_op_input_quantizer if i == len(ops) - 1 else ops[i + 1].get_input_quantizer()
            )
            x, (extra,) = op.fuser_forward(
                [basic_op_ctxs[i]],
                x,
                basic_op_extra_inputs=[basic_op_extra_inputs[i]],
                prev_op_grad_output_quantizer=prev_q,
                next_op_input_quantizer=next_q,
                basic_op_kwargs=[basic_op_kwargs[i]],
            )
            extra_outputs.append(extra)
        return x, extra_outputs

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        count = len(self.basic_ops)
        grad_params: list[list] = [[] for _ in range(count)]
        grad_extra_inputs: list[tuple] = [() for _ in range(count)]
        dx = grad_output
        for i in reversed(range(count)):
            if not basic_op_ctxs[i].requires_grad:
                break
            dx, (params,), (extras,) = self.basic_ops[i].fuser_backward(
                [basic_op_ctxs[i]], dx, basic_op_grad_extra_outputs=[basic_op_grad_extra_outputs[i]]
            )
            grad_params[i], grad_extra_inputs[i] = params, extras
        return dx, grad_params, grad_extra_inputs

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor, basic_op_kwargs=None):  # noqa: D102
        return OperationFuser([self])(input, *extra_inputs, basic_op_kwargs=basic_op_kwargs)
