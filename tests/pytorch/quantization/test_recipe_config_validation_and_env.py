"""Recipe configuration objects of transformer_engine.common.recipe: validation of the
constructor arguments (errors, not asserts; wrong types are TypeError and ValueError at once;
integer-likes normalised; lax conversions and unknown keywords: test_recipe_lax_construction.py), the
defaults read from the environment at construction (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES,
NVTE_BACKWARD_OVERRIDE), and that the module imports no torch.

The module is pure Python, so these tests need neither torch nor a GPU.
"""

from __future__ import annotations

import pytest
from recipe_config_helpers import (
    ENV_BACKWARD,
    ENV_POWER_2,
    _algo,
    _clean_recipe_env,  # noqa: F401 (autouse fixture)
    _run_python,
    _sf,
)
from utils import REPO_ROOT

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"margin": -1}, ValueError, r"margin.*-1"),
        ({"margin": "-1"}, ValueError, r"margin.*'-1'"),
        ({"margin": 1.5}, TypeError, r"margin.*1\.5"),
        ({"margin": "abc"}, TypeError, r"margin.*'abc'"),
        ({"margin": "1.5"}, TypeError, r"margin.*'1\.5'"),
        ({"margin": None}, TypeError, "margin"),
        ({"amax_history_len": 0}, ValueError, r"amax_history_len.*0"),
        ({"amax_history_len": -5}, ValueError, "amax_history_len"),
        ({"amax_history_len": 16.5}, TypeError, r"amax_history_len.*16\.5"),
        ({"amax_history_len": float("inf")}, TypeError, "amax_history_len"),
        ({"amax_history_len": False}, ValueError, "amax_history_len"),  # False is 0
        ({"fp8_format": Format.E5M2}, ValueError, r"fp8_format.*pure E5M2.*Format\.HYBRID"),
        ({"fp8_format": Format.E2M1}, ValueError, r"fp8_format.*E2M1"),
        ({"fp8_format": "HYBRID"}, TypeError, r"fp8_format.*'HYBRID'"),
        ({"fp8_format": None}, TypeError, "fp8_format"),
        ({"amax_compute_algo": "mean"}, ValueError, r"amax_compute_algo.*'mean'"),
        ({"amax_compute_algo": "MAX"}, ValueError, "amax_compute_algo"),
        ({"amax_compute_algo": 3}, TypeError, "amax_compute_algo"),
        ({"amax_compute_algo": None}, TypeError, "amax_compute_algo"),
        ({"scaling_factor_compute_algo": "default"}, TypeError, "scaling_factor_compute_algo"),
        ({"scaling_factor_compute_algo": 1.0}, TypeError, "scaling_factor_compute_algo"),
        ({"reduce_amax": 2}, TypeError, r"reduce_amax.*2"),
        ({"reduce_amax": "maybe"}, TypeError, "reduce_amax"),
        ({"reduce_amax": None}, TypeError, "reduce_amax"),
        ({"fp8_dpa": 0.5}, TypeError, "fp8_dpa"),
        ({"fp8_mha": " yes"}, TypeError, "fp8_mha"),
        ({"backward_override": "high_precision"}, ValueError, r"backward_override.*None"),
        ({"backward_override": "dequantized"}, ValueError, "backward_override"),
        ({"backward_override": "fp32"}, ValueError, r"backward_override.*'fp32'"),
        ({"backward_override": 1}, TypeError, "backward_override"),
    ],
)
def test_delayed_scaling_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match) as caught:
        DelayedScaling(**kwargs)
    # Every refusal is a ValueError, as upstream's pydantic ValidationError is.
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"use_power_2_scales": -1}, TypeError, "use_power_2_scales"),
        ({"use_power_2_scales": "2"}, TypeError, "use_power_2_scales"),
        ({"fp8_format": Format.E5M2}, ValueError, r"fp8_format.*pure E5M2.*Format\.HYBRID"),
        ({"fp8_format": Format.E2M1}, ValueError, "fp8_format"),
        ({"fp8_format": "E4M3"}, TypeError, "fp8_format"),
        ({"fp8_gemm_fprop": False}, TypeError, "fp8_gemm_fprop"),
        ({"fp8_gemm_dgrad": True}, TypeError, "fp8_gemm_dgrad"),
        ({"fp8_gemm_wgrad": None}, TypeError, "fp8_gemm_wgrad"),
        ({"fp8_dpa": 3}, TypeError, "fp8_dpa"),
        ({"fp8_mha": None}, TypeError, "fp8_mha"),
        ({"backward_override": "fp32"}, ValueError, r"backward_override.*'fp32'"),
        ({"backward_override": "HIGH_PRECISION"}, ValueError, "backward_override"),
        ({"backward_override": True}, TypeError, "backward_override"),
    ],
)
def test_float8_current_scaling_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match) as caught:
        Float8CurrentScaling(**kwargs)
    assert isinstance(caught.value, ValueError)


def test_valid_values_are_accepted():
    DelayedScaling(margin=0, amax_history_len=1)
    DelayedScaling(margin=5, fp8_format=Format.E4M3, amax_compute_algo="most_recent")
    DelayedScaling(amax_compute_algo=_algo, scaling_factor_compute_algo=_sf)
    for override in (None, "high_precision", "dequantized"):
        assert Float8CurrentScaling(backward_override=override).backward_override == override
    assert Float8CurrentScaling(fp8_format=Format.E4M3).fp8_format is Format.E4M3


def test_integer_likes_are_normalised_to_int():
    np = pytest.importorskip("numpy")
    r = DelayedScaling(margin=np.int64(2), amax_history_len=np.int32(8))
    assert type(r.margin) is int and type(r.amax_history_len) is int
    assert r == DelayedScaling(margin=2, amax_history_len=8)
    assert repr(r) == repr(DelayedScaling(margin=2, amax_history_len=8))


def test_validation_never_uses_assert():
    # Validation must survive `python -O`, which strips assert statements.
    out = _run_python(
        "from transformer_engine.common.recipe import DelayedScaling, Format\n"
        "try:\n"
        "    DelayedScaling(fp8_format=Format.E5M2)\n"
        "except ValueError as e:\n"
        "    print('raised')\n",
        "-O",
    )
    assert out == "raised"
    source = (REPO_ROOT / "transformer_engine/common/recipe/__init__.py").read_text()
    assert "\n    assert " not in source and "\nassert " not in source


# ---------------------------------------------------------------- environment defaults


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("0", False), ("", False), ("true", False), ("2", False)],
)
def test_power_2_scales_env_read_at_construction(monkeypatch, value, expected):
    assert Float8CurrentScaling().use_power_2_scales is False
    monkeypatch.setenv(ENV_POWER_2, value)
    assert Float8CurrentScaling().use_power_2_scales is expected
    # An explicit argument wins over the environment.
    assert Float8CurrentScaling(use_power_2_scales=False).use_power_2_scales is False
    assert Float8CurrentScaling(use_power_2_scales=True).use_power_2_scales is True
    monkeypatch.delenv(ENV_POWER_2)
    assert Float8CurrentScaling().use_power_2_scales is False


@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
def test_backward_override_env_read_at_construction(monkeypatch, value):
    assert Float8CurrentScaling().backward_override is None
    monkeypatch.setenv(ENV_BACKWARD, value)
    assert Float8CurrentScaling().backward_override == value
    assert Float8CurrentScaling(backward_override=None).backward_override is None
    monkeypatch.delenv(ENV_BACKWARD)
    assert Float8CurrentScaling().backward_override is None


def test_backward_override_env_empty_means_unset(monkeypatch):
    monkeypatch.setenv(ENV_BACKWARD, "")
    assert Float8CurrentScaling().backward_override is None


def test_backward_override_env_invalid_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_BACKWARD, "fp32")
    with pytest.raises(ValueError, match=r"NVTE_BACKWARD_OVERRIDE.*'fp32'"):
        Float8CurrentScaling()
    # An explicit argument does not consult the environment.
    assert Float8CurrentScaling(backward_override="dequantized").backward_override == "dequantized"


@pytest.mark.parametrize("value", ["high_precision", "dequantized", "fp32"])
def test_delayed_scaling_ignores_backward_override_env(monkeypatch, value):
    # Decision: DelayedScaling's default is None whatever NVTE_BACKWARD_OVERRIDE says (upstream
    # would fail on every DelayedScaling() while the variable is set); an explicit value raises.
    monkeypatch.setenv(ENV_BACKWARD, value)
    assert DelayedScaling().backward_override is None
    with pytest.raises(ValueError, match="backward_override"):
        DelayedScaling(backward_override="high_precision")


def test_delayed_scaling_ignores_power_2_env(monkeypatch):
    monkeypatch.setenv(ENV_POWER_2, "1")
    assert DelayedScaling() == DelayedScaling(margin=0)


# ---------------------------------------------------------------- layering


def test_recipe_module_imports_no_torch():
    out = _run_python(
        "import sys\n"
        "import transformer_engine.common.recipe\n"
        "print('torch' in sys.modules,"
        " any(m.startswith('transformer_engine.pytorch') for m in sys.modules))"
    )
    assert out == "False False"
