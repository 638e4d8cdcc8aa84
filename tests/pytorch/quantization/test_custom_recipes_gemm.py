"""``custom_recipes.gemm``: upstream's import path of the per-GEMM options record."""

from __future__ import annotations

import dataclasses

import pytest

from transformer_engine.common import recipe
from transformer_engine.pytorch.custom_recipes import gemm


def test_mmparams_is_the_recipe_record():
    # One class, so an MMParams built from either path compares equal and passes recipe checks.
    assert gemm.MMParams is recipe.MMParams
    assert gemm.MMParams().use_split_accumulator is True
    assert gemm.MMParams(False) == recipe.MMParams(use_split_accumulator=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gemm.MMParams().use_split_accumulator = False
    cs = recipe.Float8CurrentScaling(fp8_gemm_fprop=gemm.MMParams(True))
    assert cs.fp8_gemm_fprop.use_split_accumulator is True


def test_custom_gemm_is_not_offered():
    """No quantizer here has ``qgemm``, which upstream's ``custom_gemm`` dispatches to; the module
    says so instead of exporting a function that cannot work."""
    assert not hasattr(gemm, "custom_gemm")
    assert "custom_gemm" in gemm.__doc__ and "not provided" in gemm.__doc__
