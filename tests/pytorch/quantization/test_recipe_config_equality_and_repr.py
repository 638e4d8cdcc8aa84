"""Recipe configuration objects of transformer_engine.common.recipe: equality (field-wise, never
across recipe types), unhashability like upstream's, pickle and deepcopy round trips, and the
exact repr of DelayedScaling and Float8CurrentScaling.

The module is pure Python, so these tests need neither torch nor a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from recipe_config_helpers import (
    _algo,
    _clean_recipe_env,  # noqa: F401 (autouse fixture)
    _sf,
)

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format, MMParams

# ---------------------------------------------------------------- equality, hash


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_recipes_are_unhashable_like_upstreams(cls):
    # Upstream's recipes are mutable dataclasses with field-wise equality, hence unhashable.
    with pytest.raises(TypeError, match="unhashable"):
        hash(cls())
    with pytest.raises(TypeError, match="unhashable"):
        {cls()}  # noqa: B018


@pytest.mark.parametrize(
    "cls, changes",
    [
        (DelayedScaling, {"margin": 1}),
        (DelayedScaling, {"fp8_format": Format.E4M3}),
        (DelayedScaling, {"amax_history_len": 16}),
        (DelayedScaling, {"amax_compute_algo": "most_recent"}),
        (DelayedScaling, {"amax_compute_algo": _algo}),
        (DelayedScaling, {"scaling_factor_compute_algo": _sf}),
        (DelayedScaling, {"reduce_amax": False}),
        (DelayedScaling, {"fp8_dpa": True}),
        (DelayedScaling, {"fp8_mha": True}),
        (Float8CurrentScaling, {"use_power_2_scales": True}),
        (Float8CurrentScaling, {"fp8_format": Format.E4M3}),
        (Float8CurrentScaling, {"fp8_gemm_fprop": MMParams(True)}),
        (Float8CurrentScaling, {"fp8_gemm_dgrad": MMParams(False)}),
        (Float8CurrentScaling, {"fp8_gemm_wgrad": MMParams(False)}),
        (Float8CurrentScaling, {"fp8_dpa": True}),
        (Float8CurrentScaling, {"fp8_mha": True}),
        (Float8CurrentScaling, {"backward_override": "high_precision"}),
        (Float8CurrentScaling, {"backward_override": "dequantized"}),
    ],
)
def test_equality_is_field_wise(cls, changes):
    a, b = cls(**changes), cls(**changes)
    assert a == b and a is not b
    assert a != cls()
    assert dataclasses.replace(cls(), **changes) == a


def test_different_recipe_types_never_compare_equal():
    assert DelayedScaling() != Float8CurrentScaling()
    assert DelayedScaling(fp8_format=Format.E4M3) != Float8CurrentScaling(fp8_format=Format.E4M3)


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(margin=3, fp8_format=Format.E4M3, amax_history_len=7),
        DelayedScaling(amax_compute_algo=_algo, scaling_factor_compute_algo=_sf),
        Float8CurrentScaling(use_power_2_scales=True, backward_override="dequantized"),
    ],
)
def test_pickle_and_deepcopy_round_trip(recipe):
    assert pickle.loads(pickle.dumps(recipe)) == recipe
    assert copy.deepcopy(recipe) == recipe
    assert repr(copy.copy(recipe)) == repr(recipe)


# ---------------------------------------------------------------- repr


def test_delayed_scaling_repr_exact():
    assert repr(DelayedScaling()) == (
        "recipe_type=DelayedScaling, margin=0, format=HYBRID, amax_history_len=1024, "
        "reduce_amax=True, fp8_dpa=False, fp8_mha=False, backward_override=None"
    )
    assert str(DelayedScaling()) == repr(DelayedScaling())


def test_delayed_scaling_repr_shows_listed_fields():
    text = repr(
        DelayedScaling(
            margin=2,
            fp8_format=Format.E4M3,
            amax_history_len=16,
            reduce_amax=False,
            fp8_dpa=True,
            fp8_mha=True,
        )
    )
    for part in (
        "recipe_type=DelayedScaling",
        "margin=2",
        "format=E4M3",
        "amax_history_len=16",
        "reduce_amax=False",
        "fp8_dpa=True",
        "fp8_mha=True",
        "backward_override=None",
    ):
        assert part in text


def test_delayed_scaling_repr_omits_compute_algorithms():
    # The repr is part of the autocast buffer key: it must not depend on the algorithms
    # (a callable would print its address, giving every rebuilt lambda new buffers).
    plain = DelayedScaling()
    for other in (
        DelayedScaling(amax_compute_algo="most_recent"),
        DelayedScaling(amax_compute_algo=lambda h: h.max(0)),
        DelayedScaling(scaling_factor_compute_algo=lambda a, s, m, r: s),
    ):
        assert repr(other) == repr(plain)
        assert other != plain
        text = repr(other)
        assert "amax_compute_algo" not in text
        assert "scaling_factor_compute_algo" not in text
        assert "lambda" not in text and "0x" not in text


def test_float8_current_scaling_repr_exact():
    assert repr(Float8CurrentScaling()) == (
        "recipe_type=Float8CurrentScaling, format=HYBRID, use_power_2_scales=False, "
        "fp8_gemm_fprop=MMParams(use_split_accumulator=False), "
        "fp8_gemm_dgrad=MMParams(use_split_accumulator=True), "
        "fp8_gemm_wgrad=MMParams(use_split_accumulator=True), "
        "fp8_dpa=False, fp8_mha=False, backward_override=None"
    )


def test_float8_current_scaling_repr_shows_listed_fields():
    text = repr(
        Float8CurrentScaling(
            use_power_2_scales=True,
            fp8_format=Format.E4M3,
            fp8_gemm_fprop=MMParams(True),
            fp8_gemm_wgrad=MMParams(False),
            fp8_dpa=True,
            fp8_mha=True,
            backward_override="high_precision",
        )
    )
    for part in (
        "recipe_type=Float8CurrentScaling",
        "format=E4M3",
        "use_power_2_scales=True",
        "fp8_gemm_fprop=MMParams(use_split_accumulator=True)",
        "fp8_gemm_dgrad=MMParams(use_split_accumulator=True)",
        "fp8_gemm_wgrad=MMParams(use_split_accumulator=False)",
        "fp8_dpa=True",
        "fp8_mha=True",
        "backward_override=high_precision",
    ):
        assert part in text
    assert "fp8_quant" not in text


def test_repr_distinguishes_recipe_types():
    assert repr(DelayedScaling()) != repr(Float8CurrentScaling())
