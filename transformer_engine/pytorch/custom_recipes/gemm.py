"""GEMM settings for custom recipes, at upstream's import path.

:class:`MMParams` is the recipe's per-GEMM option record
(:class:`transformer_engine.common.recipe.MMParams`, frozen), re-exported here because code
written for upstream imports it from ``custom_recipes.gemm``. A ``CustomRecipe`` carries no GEMM
options of its own: the linear core reads ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` /
``fp8_gemm_wgrad`` only from recipes that define them, and runs a custom recipe's FP8 GEMMs with
its defaults (fast accumulation for fprop, split accumulation for dgrad and wgrad).

Upstream's ``custom_gemm`` (a GEMM that hands custom quantized tensors to their quantizer's
``qgemm``) is not provided: no quantizer in this package defines ``qgemm``; every tensor a
custom recipe produces here is a ``Float8Tensor`` (or a high-precision tensor), which the
package's own GEMM already takes.
"""

from ...common.recipe import MMParams

__all__ = ["MMParams"]
