"""A basic operation's extra state (``get_extra_state`` / ``set_extra_state``): its
delayed-scaling scales and histories, in the checkpoint format the modules use
(``transformer_engine.pytorch.extra_state``: a ``torch.uint8`` tensor of bytes, no pickle,
carried by ``torch.load(weights_only=True)`` and safetensors; an empty one without such state;
upstream pickles are read only behind ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``).

Loading puts the state on the operation's device whatever device wrote it. An operation whose
parameters are still on ``meta`` keeps the loaded state on the CPU; the first forward moves it
next to the materialized parameters (a rebuilt state takes over the old values).
"""

from __future__ import annotations

from typing import Any

import torch

from ..extra_state import empty_extra_state, pack_extra_state, unpack_extra_state
from ..quantization import CustomRecipeState, DelayedScalingRecipeState

__all__ = ["get_op_extra_state", "set_op_extra_state"]

_SUFFIX = {"forward": "fwd", "backward": "bwd"}


def get_op_extra_state(op) -> torch.Tensor:
    """The op's delayed-scaling scales and histories as ``pack_extra_state`` bytes (an empty
    ``torch.uint8`` tensor when it has none)."""
    tensors, recipe = {}, None
    for mode, suffix in _SUFFIX.items():
        state = op.recipe_state(mode)
        if isinstance(state, CustomRecipeState) and state.delayed_scaling_state() is not None:
            raise NotImplementedError(
                f"{type(op).__name__}: saving a checkpoint of an operation run under a "
                "CustomRecipe whose factory returned DelayedScalingRequests is not supported "
                "(the recipe's factory cannot be stored); save under DelayedScaling instead"
            )
        if isinstance(state, DelayedScalingRecipeState):
            tensors[f"scale_{suffix}"] = state.scale
            tensors[f"amax_history_{suffix}"] = state.amax_history
            recipe = op._fp8_metas[mode]["recipe"]
    if recipe is None:
        return empty_extra_state()
    return pack_extra_state(recipe, tensors, {})


def set_op_extra_state(op, state: Any) -> None:
    """Restore what :func:`get_op_extra_state` wrote (or upstream's formats)."""
    device = op.parameters_device()
    if device is None or device.type == "meta":
        current = op.recipe_state("forward") or op.recipe_state("backward")
        device = current.device if current is not None else torch.device("cpu")
    unpacked = unpack_extra_state(state, device=device)
    if unpacked is None:
        return
    recipe, tensors, _ = unpacked
    for mode, suffix in _SUFFIX.items():  # refuse another layout before anything changes
        scale = tensors.get(f"scale_{suffix}")
        if scale is not None and scale.shape[0] != op.num_quantizers(mode):
            raise ValueError(
                f"{type(op).__name__}: the checkpoint has {scale.shape[0]} {mode} "
                f"quantizers but the operation uses {op.num_quantizers(mode)}"
            )
    active = op._quantizers is not None
    op._reset_recipe_state_on(recipe, device)
    rebuilt = False
    with torch.no_grad():
        for mode, suffix in _SUFFIX.items():
            st = op.recipe_state(mode)
            if f"scale_{suffix}" not in tensors or not isinstance(st, DelayedScalingRecipeState):
                continue
            scale, history = tensors[f"scale_{suffix}"], tensors[f"amax_history_{suffix}"]
            st.scale.copy_(scale)  # same length: checked above
            if history.shape != st.amax_history.shape:
                st.amax_history = history.clone()
                rebuilt = True
            else:
                st.amax_history.copy_(history)
    if rebuilt:
        op._quantizers = {
            mode: (op.recipe_state(mode).make_quantizers() if op.num_quantizers(mode) else [])
            for mode in _SUFFIX
        }
        op._on_recipe_state_change()
    if not active:
        op.reset_recipe_state(recipe=None)
