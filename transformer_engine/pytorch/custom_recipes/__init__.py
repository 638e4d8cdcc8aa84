"""Building blocks for :class:`~transformer_engine.common.recipe.CustomRecipe` (experimental).

* ``quantizer_factories``: factories that reproduce the built-in recipes slot by slot
  (``current_scaling_factory``, ``delayed_scaling_factory``), starting points for mixed ones.
* ``reference_current_scaling``: :class:`CurrentScalingQuantizerRef`, a current-scaling
  quantizer written in plain PyTorch, a readable reference for custom quantizers.

Nothing is imported here (as upstream): import the submodule you use.
"""
