"""Upstream's deprecated module names and small name tables, imported from upstream's paths:
the ``transformer_engine.pytorch.float8_tensor`` shim, ``quantization.get_fp4_te_dtype`` and the
``constants`` tables, held to hand-written expectations."""

from __future__ import annotations

import importlib

import pytest

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.constants import DType


def test_float8_tensor_shim_warns_and_gives_the_classes():
    import sys
    import warnings

    from transformer_engine.pytorch.tensor import float8_tensor

    sys.modules.pop("transformer_engine.pytorch.float8_tensor", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shim = importlib.import_module("transformer_engine.pytorch.float8_tensor")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    for name in ("Float8Tensor", "Float8Quantizer", "Float8CurrentScalingQuantizer"):
        assert getattr(shim, name) is getattr(float8_tensor, name)


def test_get_fp4_te_dtype():
    from transformer_engine.common.recipe import NVFP4BlockScaling
    from transformer_engine.pytorch.quantization import get_fp4_te_dtype

    assert get_fp4_te_dtype(NVFP4BlockScaling()) == DType.kFloat4E2M1
    with pytest.raises(ValueError, match="no FP4 format"):
        get_fp4_te_dtype(DelayedScaling())


def test_constants_name_tables():
    from transformer_engine.pytorch import constants

    assert set(constants.AttnMaskTypes) == {
        "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
        "padding_causal_bottom_right", "arbitrary",
    }  # fmt: skip
    assert constants.AttnTypes == ("self", "cross")
    assert set(constants.AttnBiasTypes) == {"pre_scale_bias", "post_scale_bias", "no_bias", "alibi"}
    assert constants.LayerTypes == ("encoder", "decoder")
    assert constants.GemmParallelModes == ("row", "column", None)
    assert (constants.MXFP8_BLOCK_SCALING_SIZE, constants.NVFP4_BLOCK_SCALING_SIZE) == (32, 16)
    # every mask name the table lists is one DotProductAttention accepts
    for name in constants.AttnMaskTypes:
        te.DotProductAttention(2, 4, attn_mask_type=name, device="cpu")
