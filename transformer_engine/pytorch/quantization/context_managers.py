"""The user-facing context managers: ``autocast`` and ``quantized_model_init`` (and their
deprecated ``fp8_`` aliases). They only save, set and restore :class:`FP8GlobalState`
through :class:`FP8GlobalStateManager`; the state and the scale updates live in ``state.py``.
"""

from __future__ import annotations

import contextlib
import warnings

from ...common.recipe import Recipe
from .state import FP8GlobalStateManager
from .support import check_recipe_support, get_default_fp8_recipe

__all__ = ["autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init"]


class autocast:
    """Context manager that enables FP8 (or calibration) for TE modules run inside it.

    Parameters
    ----------
    enabled : bool, default True
        Run FP8 GEMMs and casts inside the region.
    calibrating : bool, default False
        Collect amaxes while computing in high precision.
    recipe : Recipe, optional
        ``get_default_recipe()`` when omitted (``DelayedScaling()`` below compute capability
        12.0 and without CUDA).
    amax_reduction_group : torch.distributed.ProcessGroup, optional
        Group over which delayed-scaling amaxes are all-reduced (MAX) at updates.
    _graph : bool, default False
        Set by CUDA-graph capture helpers: skip the update at exit.

    Notes
    -----
    The outermost enabled autocast updates forward scales when it exits normally in grad
    mode. Every exit, including one caused by an exception, restores the autocast state of the
    enclosing region; an exception skips the scale update. An instance cannot be entered while
    it is active (nest with a new instance).
    """

    __slots__ = ("enabled", "calibrating", "recipe", "amax_reduction_group", "_graph", "_saved")

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Recipe | None = None,
        amax_reduction_group=None,
        _graph: bool = False,
    ) -> None:
        self.enabled = enabled
        self.calibrating = calibrating
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self._graph = _graph
        self._saved = None

    def __enter__(self) -> autocast:
        if self._saved is not None:
            raise RuntimeError(
                "this autocast instance is already active; nest a new te.autocast(...) instead"
            )
        recipe = self.recipe if self.recipe is not None else get_default_fp8_recipe()
        if self.enabled:
            # Hardware support is a property of a device, not of the region: it is checked
            # where tensors are quantized (is_fp8_available(device=...)), since one region may
            # span the CPU and several GPUs.
            check_recipe_support(recipe)
        saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(
            self.enabled, self.calibrating, recipe, self.amax_reduction_group, self._graph
        )
        self._saved = saved
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        saved, self._saved = self._saved, None
        FP8GlobalStateManager.set_autocast_state(saved)
        FP8GlobalStateManager.autocast_exit(self.enabled, self._graph, update=exc_type is None)


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group=None,
    _graph: bool = False,
) -> autocast:
    """Deprecated alias of :class:`autocast` (``fp8_recipe`` -> ``recipe``, ``fp8_group`` ->
    ``amax_reduction_group``)."""
    warnings.warn(
        "fp8_autocast is deprecated; use te.autocast(recipe=..., amax_reduction_group=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return autocast(
        enabled, calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph
    )


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """Modules constructed inside keep their weights as quantized (FP8) parameters.

    Parameters
    ----------
    enabled : bool, default True
    recipe : Recipe, optional
        The recipe those weights are quantized with (``get_default_recipe()`` when omitted).
    preserve_high_precision_init_val : bool, default False
        Keep a CPU copy of each weight's initial high-precision values.
    """
    if recipe is not None:
        check_recipe_support(recipe)
    saved = FP8GlobalStateManager.get_model_init_state()
    FP8GlobalStateManager.set_model_init_state(
        (
            enabled,
            recipe if recipe is not None else get_default_fp8_recipe(),
            preserve_high_precision_init_val,
        )
    )
    try:
        yield
    finally:
        FP8GlobalStateManager.set_model_init_state(saved)


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """Deprecated alias of :func:`quantized_model_init`."""
    warnings.warn(
        "fp8_model_init is deprecated; use te.quantized_model_init",
        DeprecationWarning,
        stacklevel=3,
    )
    with quantized_model_init(enabled, recipe, preserve_high_precision_init_val):
        yield
