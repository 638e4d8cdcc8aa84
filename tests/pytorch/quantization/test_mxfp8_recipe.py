"""MXFP8BlockScaling: fields, validation, predicates, recipe state, support and announcement."""

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8BlockScaling, Format, MXFP8BlockScaling
from transformer_engine.pytorch.quantization import support
from transformer_engine.pytorch.quantization.recipe_state import RecipeState
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer


def test_defaults_and_predicates():
    r = MXFP8BlockScaling()
    assert (r.margin, r.fp8_format, r.fp8_dpa, r.fp8_mha, r.enable_2d_quantization) == (
        0, Format.E4M3, False, False, False,
    )  # fmt: skip
    assert r.mxfp8() and MXFP8BlockScaling.mxfp8() and not Float8BlockScaling().mxfp8()
    assert not r.float8_block_scaling() and not r.delayed()
    assert MXFP8BlockScaling(fp8_format=Format.HYBRID).fp8_format is Format.HYBRID


def test_backward_override_from_env(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert MXFP8BlockScaling().backward_override == "dequantized"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"fp8_format": Format.E5M2}, ValueError, "E5M2"),
        ({"fp8_dpa": None}, TypeError, "fp8_dpa"),
        ({"margin": -1}, ValueError, "margin"),
        ({"margin": 1.5}, TypeError, "margin"),
        ({"enable_2d_quantization": 2}, TypeError, "enable_2d_quantization"),
        ({"backward_override": "fast"}, ValueError, "backward_override"),
    ],
)
def test_invalid_fields_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MXFP8BlockScaling(**kwargs)


@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_fp8_attention_flags_are_accepted_as_upstream(flag):
    # Upstream asserts them False only for Float8BlockScaling (te_api_facts_2.md 2.1, 2.4);
    # attention itself refuses FP8 attention (tests/pytorch/attention/test_dpa_fp8_flags.py).
    r = MXFP8BlockScaling(**{flag: True})
    assert getattr(r, flag) is True and f"{flag}=True" in repr(r)
    r = MXFP8BlockScaling()
    setattr(r, flag, True)
    assert r == MXFP8BlockScaling(**{flag: True})
    with pytest.raises(ValueError, match=f"{flag}=True.*Float8BlockScaling"):
        Float8BlockScaling(**{flag: True})


def test_unknown_keyword_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="MXFP8BlockScaling: keyword argument 'amax_history_len'"):
        r = MXFP8BlockScaling(amax_history_len=4)
    assert r == MXFP8BlockScaling() and not hasattr(r, "amax_history_len")


def test_assignment_is_checked():
    r = MXFP8BlockScaling()
    with pytest.raises(ValueError, match="E5M2"):
        r.fp8_format = Format.E5M2
    assert r.fp8_format is Format.E4M3


def test_recipe_state_gives_each_slot_an_mxfp8_quantizer():
    recipe = MXFP8BlockScaling(fp8_format=Format.HYBRID, enable_2d_quantization=True)
    fwd = RecipeState.create(
        recipe, mode="forward", num_quantizers=6, device="cpu"
    ).make_quantizers()
    bwd = RecipeState.create(
        recipe, mode="backward", num_quantizers=2, device="cpu"
    ).make_quantizers()
    assert all(isinstance(q, MXFP8Quantizer) for q in fwd + bwd)
    assert all(q.rowwise_usage and q.columnwise_usage for q in fwd + bwd)
    assert [q.with_2d_quantization for q in fwd] == [False, True, False] * 2
    assert {q.dtype.name for q in fwd} == {"kFloat8E4M3"}
    assert {q.dtype.name for q in bwd} == {"kFloat8E5M2"}


def test_availability_is_native_support_and_autocast_announces_emulation(monkeypatch):
    available, reason = te.is_mxfp8_available(return_reason=True, device="cpu")
    assert available is False and "emulation" in reason
    assert support.get_align_size_for_quantization(MXFP8BlockScaling()) == 32
    monkeypatch.setattr(support, "_mxfp8_announced", False)
    m = te.Linear(32, 32, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with te.autocast(recipe=MXFP8BlockScaling()):
                m(torch.randn(16, 32))
    messages = [str(w.message) for w in caught if "exact emulation" in str(w.message)]
    assert len(messages) == 1
