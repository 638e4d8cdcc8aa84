"""The block-scaled quantizer factories of ``custom_recipes.quantizer_factories``: a
``CustomRecipe`` with ``float8_block_scaling_factory`` / ``mxfp8_factory`` trains ``te.Linear``
bit for bit as the built-in recipe does (forward, input and weight gradients), and
``nvfp4_factory`` configures each slot as upstream's factory does (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    CustomRecipe,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.pytorch.custom_recipes.quantizer_factories import (
    float8_block_scaling_factory,
    mxfp8_factory,
    nvfp4_factory,
)
from transformer_engine.pytorch.quantization import QuantizerRole


def _step(recipe, x):
    torch.manual_seed(1)
    layer = te.Linear(256, 128, device="cpu")
    x = x.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulated-GEMM notice of MXFP8/NVFP4 off Blackwell
        torch.manual_seed(2)  # stochastic rounding draws alike
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize(
    "factory, builtin",
    [(float8_block_scaling_factory, Float8BlockScaling), (mxfp8_factory, MXFP8BlockScaling)],
)
def test_factory_trains_like_the_builtin_recipe(factory, builtin):
    torch.manual_seed(0)
    x = torch.randn(128, 256) * torch.logspace(-2, 2, 256)  # block scales that differ
    for got, want in zip(_step(CustomRecipe(qfactory=factory), x), _step(builtin(), x)):
        assert torch.equal(got, want)


def test_float8_block_factory_slots():
    weight = float8_block_scaling_factory(QuantizerRole("linear", "weight"))
    grouped = float8_block_scaling_factory(QuantizerRole("grouped_linear", "weight"))
    other_weight = float8_block_scaling_factory(QuantizerRole("attention", "weight"))
    grad = float8_block_scaling_factory(QuantizerRole("linear", "grad_output"))
    boundary = float8_block_scaling_factory(None)
    assert weight.block_scaling_dim == grouped.block_scaling_dim == 2
    assert (
        other_weight.block_scaling_dim == grad.block_scaling_dim == boundary.block_scaling_dim == 1
    )
    for q in (weight, grad, boundary):
        assert q.dtype == te.DType.kFloat8E4M3 and q.force_pow_2_scales and q.amax_epsilon == 0.0


def test_nvfp4_factory_slots():
    weight = nvfp4_factory(QuantizerRole("linear", "weight"))
    grad = nvfp4_factory(QuantizerRole("linear", "grad_output"))
    inp = nvfp4_factory(QuantizerRole("linear", "input"))
    assert weight.with_2d_quantization and not weight.with_rht and not weight.stochastic_rounding
    assert grad.with_rht and grad.with_post_rht_amax and grad.stochastic_rounding
    assert inp.with_rht and not inp.with_post_rht_amax and not inp.stochastic_rounding
    assert not grad.with_2d_quantization and not inp.with_2d_quantization


def test_nvfp4_factory_forward_equals_the_builtin_recipe():
    # The forward GEMM reads the row-wise copies, which neither configuration transforms, and
    # both quantize the weight in 16x16 blocks: the outputs are the same bits.
    torch.manual_seed(0)
    x = torch.randn(128, 256)
    got = _step(CustomRecipe(qfactory=nvfp4_factory), x)[0]
    want = _step(NVFP4BlockScaling(), x)[0]
    assert torch.equal(got, want)
