"""Recipes accept and convert arguments as upstream's pydantic dataclasses do (lax mode), drop
unknown keyword arguments with a warning instead of raising, and refuse a wrong type with an
error that is both a TypeError and a ValueError (upstream raises pydantic's ValidationError, a
ValueError). Assigned field values go through the same conversion; other attributes may be set.

Oracle: the expected values below were written by hand from pydantic 2's documented lax-mode
conversion table and checked against pydantic 2.14 (te_api_facts.md section 1: "numeric strings
are coerced", wrong types raise ValidationError, unknown kwargs are dropped). Where pydantic is
importable, ``test_conversions_match_pydantic`` compares against it directly.
"""

from __future__ import annotations

import decimal
import fractions
import inspect
import warnings

import pytest
from recipe_config_helpers import _clean_recipe_env  # noqa: F401 (autouse fixture)

from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    RecipeTypeError,
)

D = decimal.Decimal

# (value, expected int); None: refused
INT_CASES = [
    (16, 16), (16.0, 16), ("16", 16), (" 16 ", 16), ("\t3\n", 3), ("16.0", 16), ("16.00", 16),
    ("1_000", 1000), ("+5", 5), ("00016", 16), (b"7", 7), (D("3"), 3), (fractions.Fraction(4, 1), 4),
    (True, 1), (False, 0),
    (16.5, None), ("16.5", None), ("16.", None), ("1e3", None), ("0x10", None), ("abc", None),
    ("", None), ("1__0", None), (None, None), ([1], None), (float("inf"), None),
    (float("nan"), None), (D("3.5"), None),
]  # fmt: skip
# (value, expected bool); None: refused
BOOL_CASES = [
    (True, True), (False, False), (1, True), (0, False), (1.0, True), (0.0, False),
    ("true", True), ("TRUE", True), ("tRuE", True), ("false", False), ("yes", True),
    ("no", False), ("on", True), ("off", False), ("t", True), ("f", False), ("y", True),
    ("n", False), ("1", True), ("0", False), (b"true", True), (D(1), True),
    (2, None), (-1, None), (1.5, None), (" true", None), ("", None), ("2", None), (None, None),
    ("maybe", None), ([], None),
]  # fmt: skip
# (value, expected float); None: refused
FLOAT_CASES = [
    (0.5, 0.5), (1, 1.0), (True, 1.0), ("1e-3", 0.001), (" 1.5 ", 1.5), ("1_000.5", 1000.5),
    (b"1.5", 1.5), (D("1.5"), 1.5),
    ("abc", None), ("1.5e", None), (None, None), ([0.5], None),
]  # fmt: skip


def _refused(call):
    with pytest.raises(ValueError) as caught:
        call()
    assert isinstance(caught.value, TypeError), "a wrong type is a TypeError too"
    assert isinstance(caught.value, RecipeTypeError)  # importable from the public module
    return str(caught.value)


@pytest.mark.parametrize("value, expected", INT_CASES)
def test_int_fields_convert_like_pydantic(value, expected):
    if expected is None:
        message = _refused(lambda: DelayedScaling(margin=value))
        assert "margin" in message and repr(value) in message and "integer" in message
        return
    r = DelayedScaling(margin=value)
    assert type(r.margin) is int and r.margin == expected
    assert r == DelayedScaling(margin=expected) and repr(r) == repr(DelayedScaling(margin=expected))
    if expected >= 1:
        assert DelayedScaling(amax_history_len=value).amax_history_len == expected
        alignment = CustomRecipe(qfactory=print, quantization_alignment=value)
        assert alignment.quantization_alignment == expected
    if expected in (1, 2):
        recipe = Float8BlockScaling(x_block_scaling_dim=value, w_block_scaling_dim=1)
        assert recipe.x_block_scaling_dim == expected


@pytest.mark.parametrize("value, expected", BOOL_CASES)
def test_bool_fields_convert_like_pydantic(value, expected):
    if expected is None:
        message = _refused(lambda: DelayedScaling(reduce_amax=value))
        assert "reduce_amax" in message and repr(value) in message and "True or False" in message
        return
    r = DelayedScaling(reduce_amax=value, fp8_dpa=value)
    assert r.reduce_amax is expected and r.fp8_dpa is expected
    assert Float8CurrentScaling(use_power_2_scales=value).use_power_2_scales is expected
    assert MMParams(use_split_accumulator=value).use_split_accumulator is expected
    assert QParams(stochastic_rounding=value).stochastic_rounding is expected


@pytest.mark.parametrize("value, expected", FLOAT_CASES)
def test_float_fields_convert_like_pydantic(value, expected):
    if expected is None:
        message = _refused(lambda: QParams(amax_epsilon=value))
        assert "amax_epsilon" in message and repr(value) in message
        return
    q = QParams(amax_epsilon=value)
    assert type(q.amax_epsilon) is float and q.amax_epsilon == expected


def test_numpy_scalars_count_as_their_values():
    np = pytest.importorskip("numpy")
    r = DelayedScaling(margin=np.float64(3.0), reduce_amax=np.bool_(False), fp8_mha=np.int64(1))
    assert (r.margin, r.reduce_amax, r.fp8_mha) == (3, False, True)
    assert type(r.margin) is int and type(r.reduce_amax) is bool
    _refused(lambda: DelayedScaling(margin=np.float32(2.5)))
    _refused(lambda: DelayedScaling(reduce_amax=np.int64(2)))


def test_str_enum_and_nested_fields_convert_like_pydantic():
    assert Float8CurrentScaling(backward_override=b"dequantized").backward_override == "dequantized"
    assert DelayedScaling(amax_compute_algo=b"most_recent").amax_compute_algo == "most_recent"
    _refused(lambda: Float8CurrentScaling(backward_override=1))
    # An enum takes a member's value; not its name, nor anything else.
    assert DelayedScaling(fp8_format=(448, 448)).fp8_format is Format.E4M3
    assert DelayedScaling(fp8_format=(448, 57344)).fp8_format is Format.HYBRID
    for bad in ("HYBRID", 0, None):
        _refused(lambda bad=bad: DelayedScaling(fp8_format=bad))
    with pytest.raises(ValueError, match="E5M2"):
        DelayedScaling(fp8_format=(57344, 57344))
    # A nested dataclass takes a dict of its fields, converted the same way.
    r = Float8CurrentScaling(fp8_gemm_fprop={"use_split_accumulator": "yes"})
    assert r.fp8_gemm_fprop == MMParams(use_split_accumulator=True)
    for bad in ((False,), False, None):
        _refused(lambda bad=bad: Float8CurrentScaling(fp8_gemm_fprop=bad))


# ---------------------------------------------------------------- unknown keyword arguments


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (DelayedScaling, {"foo": 1}),
        (DelayedScaling, {"use_power_2_scales": True}),
        (Float8CurrentScaling, {"margin": 1, "amax_history_len": 4}),
        (Float8CurrentScaling, {"fp8_quant_fwd_inp": QParams(power_2_scale=True)}),
        (Float8BlockScaling, {"fp8_quant_fwd_weight": QParams()}),
        (MXFP8BlockScaling, {"reduce_amax": False}),
        (NVFP4BlockScaling, {"fp4_quant_fwd_inp": QParams()}),
    ],
)
def test_unknown_keywords_are_dropped_with_a_warning(cls, kwargs):
    with pytest.warns(UserWarning) as record:
        recipe = cls(**kwargs)
    messages = [str(w.message) for w in record]
    for name in kwargs:
        assert any(f"{cls.__name__}: keyword argument {name!r}" in m for m in messages), messages
    assert all(w.filename == __file__ for w in record), "the warning points at the caller"
    assert recipe == cls()  # dropped: the recipe is the one built without them


def test_unknown_keyword_warning_suggests_the_field():
    with pytest.warns(UserWarning, match=r"'amax_histroy_len'.*did you mean 'amax_history_len'"):
        assert DelayedScaling(amax_histroy_len=4).amax_history_len == 1024


def test_params_drop_unknown_keywords_too():
    with pytest.warns(UserWarning, match="MMParams: keyword argument 'fast'"):
        assert MMParams(fast=True) == MMParams()
    with pytest.warns(UserWarning, match="QParams: keyword argument 'x'"):
        assert QParams(x=1) == QParams()
    # also inside a dict given for a nested field
    with pytest.warns(UserWarning, match="MMParams: keyword argument 'fast'"):
        recipe = Float8CurrentScaling(fp8_gemm_dgrad={"use_split_accumulator": 0, "fast": 1})
    assert recipe.fp8_gemm_dgrad == MMParams(False)


def test_a_call_that_does_not_fit_is_a_value_error_naming_the_class():
    message = _refused(lambda: CustomRecipe())
    assert "CustomRecipe" in message and "qfactory" in message
    message = _refused(lambda: MMParams(True, False))
    assert "MMParams" in message and "use_split_accumulator" in message


def test_signatures_are_the_constructors():
    params = list(inspect.signature(DelayedScaling).parameters)
    assert params[:9] == [
        "margin", "fp8_format", "amax_history_len", "amax_compute_algo",
        "scaling_factor_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha", "backward_override",
    ]  # fmt: skip
    assert list(inspect.signature(MMParams).parameters) == ["use_split_accumulator"]


# ---------------------------------------------------------------- assignments


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("amax_history_len", 16.0, 16),
        ("amax_history_len", "16", 16),
        ("margin", "2", 2),
        ("reduce_amax", 0, False),
        ("fp8_dpa", "true", True),
        ("fp8_format", (448, 448), Format.E4M3),
    ],
)
def test_assigned_values_convert_like_the_constructor(name, value, expected):
    recipe = DelayedScaling()
    setattr(recipe, name, value)
    got = getattr(recipe, name)
    assert got == expected and type(got) is type(expected)
    assert recipe == DelayedScaling(**{name: value})


@pytest.mark.parametrize(
    "name, value", [("margin", "abc"), ("amax_history_len", 16.5), ("reduce_amax", 2)]
)
def test_assigned_wrong_types_are_value_errors_and_change_nothing(name, value):
    recipe = DelayedScaling()
    message = _refused(lambda: setattr(recipe, name, value))
    assert name in message and repr(value) in message
    assert recipe == DelayedScaling()


def test_any_other_attribute_can_be_set():
    for recipe in (DelayedScaling(), Float8CurrentScaling(), MXFP8BlockScaling()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            recipe.my_tag = 1
        assert recipe.my_tag == 1 and recipe == type(recipe)()


def test_conversions_match_pydantic():
    pydantic = pytest.importorskip("pydantic")

    @pydantic.dataclasses.dataclass
    class Model:
        i: int = 0
        b: bool = False
        f: float = 0.0

    for field, cases, make in [
        ("i", INT_CASES, lambda v: DelayedScaling(margin=v).margin),
        ("b", BOOL_CASES, lambda v: DelayedScaling(reduce_amax=v).reduce_amax),
        ("f", FLOAT_CASES, lambda v: QParams(amax_epsilon=v).amax_epsilon),
    ]:
        for value, _ in cases:
            try:
                expected = getattr(Model(**{field: value}), field)
            except pydantic.ValidationError:
                expected = None
            if field == "i" and expected is not None and expected < 0:
                continue  # margin's own range check
            try:
                got = make(value)
            except ValueError:
                got = None
            assert got == expected, (field, value)
