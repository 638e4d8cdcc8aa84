"""FP8 attention flags (``fp8_dpa`` / ``fp8_mha``) of the autocast recipe in DotProductAttention.

FP8 attention runs by emulation here (test_fp8_attention.py checks its numbers). Facts:
- every recipe but ``Float8BlockScaling`` accepts the flags (``MXFP8BlockScaling`` included);
- ``NVTE_DPA_FP8_RECIPE=F16`` makes attention run in high precision and sets ``fp8_dpa`` and
  ``fp8_mha`` of the autocast recipe to False; ``DelayedScaling`` / ``Float8CurrentScaling``
  give attention a recipe of its own (settings from ``NVTE_DPA_FP8*`` variables).
So: with ``F16`` attention must equal the high-precision result (the float64 oracle of
test_dpa_numerics.py) and the recipe's flags must read False afterwards; without it, attention
runs in FP8 (close to, not equal to, the high-precision result), and MXFP8 is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_dpa_numerics import FP32_TOL, bhsd, oracle_attention, oracle_output, random_qkv

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.custom_recipes.quantizer_factories import current_scaling_factory

ENV = "NVTE_DPA_FP8_RECIPE"


@pytest.fixture(autouse=True)
def _no_dpa_recipe_env(monkeypatch):
    for name in (ENV, "NVTE_DPA_FP8_FORMAT", "NVTE_DPA_FP8_RECIPE_DPA", "NVTE_DPA_FP8_RECIPE_MHA",
                 "NVTE_DPA_FP8DS_AMAX_HISTLEN", "NVTE_DPA_FP8DS_AMAX_ALGO"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _recipes(**flags):
    return [
        DelayedScaling(**flags),
        Float8CurrentScaling(**flags),
        MXFP8BlockScaling(**flags),
        CustomRecipe(qfactory=current_scaling_factory, **flags),
    ]


def _qkv(seed=40):
    return random_qkv(2, 8, 8, 2, 2, 16, seed=seed)


def _oracle(q, k, v):
    return oracle_output(oracle_attention(bhsd(q), bhsd(k), bhsd(v)), "bshd")


def _attend(dpa, recipe, q, k, v):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated MXFP8 GEMMs are announced
        with te.autocast(enabled=True, recipe=recipe):
            return dpa(q, k, v)


@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
@pytest.mark.parametrize("index", [0, 1, 3], ids=["DS", "CS", "Custom"])
def test_fp8_attention_runs_in_fp8(index, flag):
    # FP8 attention (emulated: test_fp8_attention.py holds its numbers against an oracle)
    # gives FP8-rounded results: close to the high-precision ones, not equal to them.
    recipe = _recipes(**{flag: True})[index]
    q, k, v = _qkv()
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    out = _attend(dpa, recipe, q, k, v)
    exact = _oracle(q, k, v)
    assert not torch.allclose(out.double(), exact, **FP32_TOL)
    torch.testing.assert_close(out.double(), exact, rtol=0.1, atol=0.1)
    assert recipe.fp8_dpa is True  # fp8_mha implies it (upstream sets the flag)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_mxfp8_fp8_dpa_is_refused_by_attention_not_by_the_recipe():
    recipe = MXFP8BlockScaling(fp8_dpa=True)  # accepted, as upstream
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    with pytest.raises(NotImplementedError, match="FP8 attention with MXFP8BlockScaling"):
        _attend(dpa, recipe, *_qkv())
    with pytest.raises(ValueError, match="fp8_dpa"):
        Float8BlockScaling(fp8_dpa=True)  # the one recipe that refuses the flag itself


def test_delayed_scaling_attention_among_current_scaling_linears(monkeypatch):
    # NVTE_DPA_FP8_RECIPE gives attention a recipe of its own, with its DS settings from the
    # environment; the linears keep the autocast recipe
    monkeypatch.setenv(ENV, "DelayedScaling")
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_HISTLEN", "4")
    monkeypatch.setenv("NVTE_DPA_FP8DS_AMAX_ALGO", "max")
    recipe = Float8CurrentScaling(fp8_dpa=True)
    q, k, v = _qkv(seed=45)
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    linear = te.Linear(32, 32, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with te.autocast(enabled=True, recipe=recipe):
            out = dpa(q, k, v)
            y = linear(out)
    expected = DelayedScaling(amax_history_len=4, amax_compute_algo="max", fp8_dpa=True)
    assert dpa.fp8_meta["recipe"] == expected
    assert linear.fp8_meta["recipe"] == recipe
    assert isinstance(dpa.quantizers["scaling_fwd"][2], te.Float8Quantizer)
    history = dpa.fp8_meta["scaling_fwd"].amax_history
    assert history.shape == (4, 9)
    # the autocast exit updated the attention's delayed scaling state: QKV slot = 448 / amax
    amax = max(float(t.detach().abs().max()) for t in (q, k, v))
    assert abs(dpa.fp8_meta["scaling_fwd"].scale[2].item() - 448.0 / amax) < 1e-3 * 448 / amax
    (y.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_current_scaling_attention_and_the_flags_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "Float8CurrentScaling")
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = _qkv(seed=46)
    out = _attend(dpa, DelayedScaling(fp8_dpa=True), q, k, v)
    assert isinstance(dpa.quantizers["scaling_fwd"][2], te.Float8CurrentScalingQuantizer)
    assert not torch.allclose(out.double(), _oracle(q, k, v), **FP32_TOL)  # FP8, not exact
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE_DPA", "0")  # the switched recipe's flag: off
    out = _attend(dpa, DelayedScaling(fp8_dpa=True), q, k, v)
    torch.testing.assert_close(out.double(), _oracle(q, k, v), **FP32_TOL)


@pytest.mark.parametrize(
    "env,error,match",
    [
        ({ENV: "f16"}, ValueError, "NVTE_DPA_FP8_RECIPE='f16' is not one of"),
        ({ENV: "DelayedScaling", "NVTE_DPA_FP8_FORMAT": "E4M4"}, ValueError, "E4M4"),
        ({ENV: "MXFP8BlockScaling"}, NotImplementedError, "MXFP8BlockScaling is not built"),
        ({ENV: "DelayedScaling", "NVTE_DPA_FP8DS_AMAX_HISTLEN": "0"}, ValueError, "HISTLEN='0'"),
    ],
)
def test_bad_attention_recipes_are_refused(monkeypatch, env, error, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    with pytest.raises(error, match=match):
        _attend(dpa, DelayedScaling(fp8_dpa=True), *_qkv())


@pytest.mark.parametrize(
    "flags", [{"fp8_dpa": True}, {"fp8_mha": True}, {"fp8_dpa": True, "fp8_mha": True}]
)
@pytest.mark.parametrize("index", range(4), ids=["DS", "CS", "MXFP8", "Custom"])
def test_f16_runs_high_precision_and_clears_the_flags(monkeypatch, flags, index):
    monkeypatch.setenv(ENV, "F16")
    recipe = _recipes(**flags)[index]
    q, k, v = _qkv(seed=41 + index)
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    out = _attend(dpa, recipe, q, k, v)
    torch.testing.assert_close(out.double(), _oracle(q, k, v), **FP32_TOL)
    assert (recipe.fp8_dpa, recipe.fp8_mha) == (False, False)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_f16_leaves_a_recipe_without_the_flags_untouched(monkeypatch):
    monkeypatch.setenv(ENV, "F16")
    recipe = DelayedScaling(margin=1)
    recipe.my_tag = "kept"
    q, k, v = _qkv()
    dpa = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")
    out = _attend(dpa, recipe, q, k, v)
    torch.testing.assert_close(out.double(), _oracle(q, k, v), **FP32_TOL)
    assert recipe == DelayedScaling(margin=1) and recipe.my_tag == "kept"


def test_f16_outside_fp8_autocast_changes_nothing(monkeypatch):
    monkeypatch.setenv(ENV, "F16")
    recipe = DelayedScaling(fp8_dpa=True)
    q, k, v = _qkv()
    out = DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="no_mask")(q, k, v)
    torch.testing.assert_close(out.double(), _oracle(q, k, v), **FP32_TOL)
    assert recipe.fp8_dpa is True


def test_f16_multihead_attention_matches_the_recipe_without_flags(monkeypatch):
    # MultiheadAttention with fp8_mha under F16 computes what the same recipe without the
    # flags computes (upstream: fp8_dpa = fp8_mha = False), step after step.
    monkeypatch.setenv(ENV, "F16")
    torch.manual_seed(0)
    flagged = MultiheadAttention(32, 2, attention_dropout=0.0, device="cpu")
    plain = MultiheadAttention(32, 2, attention_dropout=0.0, device="cpu")
    plain.load_state_dict(flagged.state_dict())
    recipe = DelayedScaling(amax_history_len=2, fp8_mha=True)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(8, 2, 32, generator=g) * (1 + step)
        outs = []
        for model, r in ((flagged, recipe), (plain, DelayedScaling(amax_history_len=2))):
            with te.autocast(enabled=True, recipe=r):
                y = model(x)
            y.sum().backward()
            outs.append(y.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        assert (recipe.fp8_dpa, recipe.fp8_mha) == (False, False), step
    for a, b in zip(flagged.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
