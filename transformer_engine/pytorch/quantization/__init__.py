"""FP8 quantization state: autocast, recipe state, the amax registry and the scale updates.

What each file holds:

* ``support.py``: whether FP8 works on a device, which recipes are implemented, the default
  recipe and the GEMM alignment a recipe needs.
* ``state.py``: :class:`FP8GlobalState` (the only process-wide quantization state: autocast
  flags and the amax registry) and its facade :class:`FP8GlobalStateManager`, which registers
  modules' delayed-scaling state and runs the reduce-and-update of one direction.
* ``context_managers.py``: the context managers ``autocast`` / ``quantized_model_init`` (and their
  deprecated ``fp8_`` aliases).
* ``recipe_state.py``: per-module, per-direction state built from a recipe (delayed scaling:
  ``scale`` and ``amax_history`` on the owner's device) and the quantizers that view it;
  :class:`CustomRecipeState` asks a ``CustomRecipe``'s factory for each slot's quantizer.
* ``quantizer_roles.py``: :class:`QuantizerRole` (what a slot quantizes) and the requests a
  ``CustomRecipe`` factory may answer with (:class:`DelayedScalingRequest`).
* ``amax_registry.py``: :class:`AmaxKey` (direction, recipe by value, reduction group by
  identity) and the registry that groups registered pairs by device, reduces their amaxes and
  runs the fused update.
* ``update_graph.py``: a device group's fused update captured once as a CUDA graph, replayed
  from the group's second update on (a graph launch costs less host time than a native call).
* ``delayed_scaling_update.py``: the unfused PyTorch update, used for recipes with callable
  ``amax_compute_algo`` / ``scaling_factor_compute_algo``.
* ``backward_update.py``: :class:`BackwardScaleUpdate`, the one owner of the backward update.

When scales update (delayed scaling):

* forward scales, when the outermost *enabled* autocast exits normally in grad mode;
* backward scales, by the one owner :class:`BackwardScaleUpdate`: the region's first FP8
  module or fuser claims it in forward (:func:`claim_backward_update`) and completes it at the
  end of its backward, which autograd runs last in the region.

An autocast that exits because of an exception restores the state and performs no update.
"""

from .backward_update import BackwardScaleUpdate, claim_backward_update
from .context_managers import autocast, fp8_autocast, fp8_model_init, quantized_model_init
from .delayed_scaling_update import (
    _amax_and_scale_update,
    _compute_amax_and_update_history,
    _compute_scaling_factor,
    _default_get_amax_and_update_history,
    _default_sf_compute,
    _update_amax_history,
    split_and_copy,
)
from .quantizer_roles import DelayedScalingRequest, QuantizerRequest, QuantizerRole
from .recipe_state import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    NVFP4BlockScalingRecipeState,
    RecipeState,
    get_fp4_te_dtype,
    get_fp8_max,
    get_fp8_te_dtype,
    get_fp8_torch_dtype,
)
from .state import FP8GlobalState, FP8GlobalStateManager
from .support import (
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    check_recipe_support,
    get_align_size_for_quantization,
    get_default_fp8_recipe,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)

__all__ = [
    "autocast",
    "fp8_autocast",
    "quantized_model_init",
    "fp8_model_init",
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
    "FP8GlobalStateManager",
    "FP8GlobalState",
    "RecipeState",
    "DelayedScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "Float8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState",
    "CustomRecipeState",
    "QuantizerRole",
    "QuantizerRequest",
    "DelayedScalingRequest",
    "get_fp8_torch_dtype",
    "get_fp8_te_dtype",
    "get_fp4_te_dtype",
    "get_fp8_max",
    "_amax_and_scale_update",
    "_compute_amax_and_update_history",
    "_compute_scaling_factor",
    "_default_get_amax_and_update_history",
    "_default_sf_compute",
    "_update_amax_history",
    "split_and_copy",
    "BackwardScaleUpdate",
    "claim_backward_update",
]
