"""Recipe configuration objects of transformer_engine.common.recipe: the Format maxima, MMParams
and QParams, the fields and defaults of DelayedScaling and Float8CurrentScaling (with the
per-role QParams fixed at import time), and the recipe-type predicates. Equality and repr:
test_recipe_config_equality_and_repr.py; validation and environment defaults:
test_recipe_config_validation_and_env.py; assignment after construction:
test_recipe_mutability.py.

The module is pure Python, so these tests need neither torch nor a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
from recipe_config_helpers import (
    ENV_POWER_2,
    _clean_recipe_env,  # noqa: F401 (autouse fixture)
    _run_python,
)

from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
    Recipe,
)


def _field_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        else:
            out[f.name] = f.default_factory()
    return out


# ---------------------------------------------------------------- Format


@pytest.mark.parametrize(
    "member, max_fwd, max_bwd",
    [
        (Format.E2M1, 6, 6),
        (Format.E4M3, 448, 448),
        (Format.E5M2, 57344, 57344),
        (Format.HYBRID, 448, 57344),
    ],
)
def test_format_maxima(member, max_fwd, max_bwd):
    assert member.value.max_fwd == max_fwd
    assert member.value.max_bwd == max_bwd
    assert tuple(member.value) == (max_fwd, max_bwd)
    assert member.value._fields == ("max_fwd", "max_bwd")


def test_format_members_are_distinct_and_looked_up_by_name():
    assert [m.name for m in Format] == ["E2M1", "E4M3", "E5M2", "HYBRID"]
    for m in Format:
        assert Format[m.name] is m
        assert Format(m.value) is m


# ---------------------------------------------------------------- MMParams / QParams


def test_mm_params_defaults_and_frozen():
    assert MMParams().use_split_accumulator is True
    assert MMParams(False) == MMParams(use_split_accumulator=False)
    assert hash(MMParams()) == hash(MMParams(True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        MMParams().use_split_accumulator = False


def test_q_params_defaults_and_frozen():
    q = QParams()
    assert _field_defaults(QParams) == {
        "power_2_scale": False,
        "amax_epsilon": 0.0,
        "random_hadamard_transform": False,
        "stochastic_rounding": False,
        "fp4_2d_quantization": False,
    }
    assert q == QParams(False, 0.0, False, False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.amax_epsilon = 1.0


def test_q_params_epsilon_is_normalised_to_float():
    q = QParams(amax_epsilon=1)
    assert isinstance(q.amax_epsilon, float)
    assert q == QParams(amax_epsilon=1.0)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"use_split_accumulator": 2}, TypeError, "use_split_accumulator"),
        ({"use_split_accumulator": None}, TypeError, "use_split_accumulator"),
    ],
)
def test_mm_params_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MMParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"power_2_scale": 2}, TypeError, "power_2_scale"),
        ({"random_hadamard_transform": "yess"}, TypeError, "random_hadamard_transform"),
        ({"stochastic_rounding": None}, TypeError, "stochastic_rounding"),
        ({"fp4_2d_quantization": 0.5}, TypeError, "fp4_2d_quantization"),
        ({"amax_epsilon": "small"}, TypeError, "amax_epsilon"),
        ({"amax_epsilon": None}, TypeError, "amax_epsilon"),
        ({"amax_epsilon": -1e-3}, ValueError, "amax_epsilon"),
        ({"amax_epsilon": float("nan")}, ValueError, "amax_epsilon"),
        ({"amax_epsilon": float("inf")}, ValueError, "amax_epsilon"),
    ],
)
def test_q_params_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        QParams(**kwargs)


# ---------------------------------------------------------------- defaults


def test_delayed_scaling_fields_and_defaults():
    # Field order is the positional-argument order of upstream's constructor.
    assert _field_defaults(DelayedScaling) == {
        "margin": 0,
        "fp8_format": Format.HYBRID,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None,
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    }
    assert list(_field_defaults(DelayedScaling)) == [
        "margin",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
        "backward_override",
    ]
    r = DelayedScaling()
    for name, value in _field_defaults(DelayedScaling).items():
        assert getattr(r, name) == value, name


def test_delayed_scaling_positional_arguments():
    r = DelayedScaling(2, Format.E4M3, 16, "most_recent")
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        2,
        Format.E4M3,
        16,
        "most_recent",
    )


def test_float8_current_scaling_fields_and_defaults():
    assert _field_defaults(Float8CurrentScaling) == {
        "use_power_2_scales": False,
        "fp8_format": Format.HYBRID,
        "fp8_gemm_fprop": MMParams(use_split_accumulator=False),
        "fp8_gemm_dgrad": MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": MMParams(use_split_accumulator=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    }
    r = Float8CurrentScaling()
    assert r.use_power_2_scales is False
    assert r.fp8_format is Format.HYBRID
    assert r.fp8_gemm_fprop == MMParams(False)
    assert r.fp8_gemm_dgrad == MMParams(True)
    assert r.fp8_gemm_wgrad == MMParams(True)
    assert (r.fp8_dpa, r.fp8_mha, r.backward_override) == (False, False, None)


@pytest.mark.parametrize(
    "name", ["fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"]
)
def test_float8_current_scaling_role_qparams_are_class_attributes(name):
    assert name not in {f.name for f in dataclasses.fields(Float8CurrentScaling)}
    value = getattr(Float8CurrentScaling, name)
    assert isinstance(value, QParams)
    assert getattr(Float8CurrentScaling(), name) is value
    # Not a constructor argument: upstream drops it silently; here it is dropped with a warning.
    with pytest.warns(
        UserWarning, match=f"'{name}' is not a constructor argument.*class attribute"
    ):
        recipe = Float8CurrentScaling(**{name: QParams(power_2_scale=not value.power_2_scale)})
    assert getattr(recipe, name) is value


def test_role_qparams_are_fixed_at_import_time():
    code = (
        "from transformer_engine.common.recipe import Float8CurrentScaling as R\n"
        "print(R.fp8_quant_fwd_inp.power_2_scale, R.fp8_quant_fwd_weight.power_2_scale,"
        " R.fp8_quant_bwd_grad.power_2_scale, R.fp8_quant_bwd_grad.amax_epsilon)"
    )
    assert _run_python(code) == "False False False 0.0"
    assert _run_python(code, **{ENV_POWER_2: "1"}) == "True True True 0.0"


def test_role_qparams_do_not_follow_later_env_changes(monkeypatch):
    before = Float8CurrentScaling.fp8_quant_fwd_inp
    monkeypatch.setenv(ENV_POWER_2, "0" if before.power_2_scale else "1")
    assert Float8CurrentScaling().fp8_quant_fwd_inp is before


# ---------------------------------------------------------------- predicates

PREDICATES = (
    "nvfp4",
    "mxfp8",
    "delayed",
    "float8_current_scaling",
    "float8_per_tensor_scaling",
    "float8_block_scaling",
    "custom",
)


@pytest.mark.parametrize(
    "cls, true_ones",
    [
        (Recipe, set()),
        (DelayedScaling, {"delayed", "float8_per_tensor_scaling"}),
        (Float8CurrentScaling, {"float8_current_scaling", "float8_per_tensor_scaling"}),
    ],
)
def test_predicates(cls, true_ones):
    instance = cls()
    for name in PREDICATES:
        expected = name in true_ones
        assert getattr(cls, name)() is expected, (cls.__name__, name)
        assert getattr(instance, name)() is expected, (cls.__name__, name)


def test_predicates_see_subclasses():
    @dataclasses.dataclass(repr=False)
    class MyDelayed(DelayedScaling):
        pass

    assert MyDelayed.delayed() and MyDelayed().float8_per_tensor_scaling()
    assert not MyDelayed.float8_current_scaling()


def test_recipes_are_recipes():
    assert isinstance(DelayedScaling(), Recipe)
    assert isinstance(Float8CurrentScaling(), Recipe)
