"""``te.make_graphed_callables`` on modules whose weights are FP8 themselves
(``te.quantized_model_init``), and on a ``TransformerLayer`` called with a padding mask as a
keyword argument: graphed against the same modules run eagerly.

The oracle is the eager module built from the same seed: over 5 training steps with SGD updates
(which requantize the FP8 weights in place), outputs, input gradients, parameter gradients, the
weights themselves (their FP8 bytes and scales) and the modules' FP8 state are bit for bit the
same.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import DTYPE, assert_same, cuda_device, fp8_state, sgd
from test_make_graphed_callables import step
from utils import make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

SEQ, BATCH, HIDDEN, HEADS, FFN = 32, 2, 128, 4, 256
STEPS = 5


def build(kind: str, recipe, device) -> torch.nn.Module:
    torch.manual_seed(1234)
    kw = dict(params_dtype=DTYPE, device=device)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        if kind == "linear":
            return te.Linear(HIDDEN, HIDDEN, **kw)
        if kind == "layernorm_mlp":
            return te.LayerNormMLP(HIDDEN, FFN, **kw)
        # fuse_qkv_params: FP8 weights are not split into query, key and value parameters
        return te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                   fuse_qkv_params=True, **kw)  # fmt: skip


def weights(model) -> list:
    """Each parameter's bytes as the module holds them: an FP8 weight's data and scale."""
    out = []
    for p in model.parameters():
        if isinstance(p, QuantizedTensor):
            out += [p.dequantize().clone(), p._scale_inv.clone()]
        else:
            out.append(p.detach().clone())
    return out


def data(device, steps=STEPS) -> list:
    g = torch.Generator().manual_seed(0)
    shape = (SEQ, BATCH, HIDDEN)
    return [
        (torch.randn(shape, generator=g).to(device, DTYPE),
         torch.randn(shape, generator=g).to(device, DTYPE))
        for _ in range(steps)
    ]  # fmt: skip


def compare(eager, graphed, recipe, device, **kwargs) -> None:
    for i, (x, dy) in enumerate(data(device)):
        assert_same(step(eager, x, dy, recipe, **kwargs), step(graphed, x, dy, recipe, **kwargs),
                    f"step {i}")  # fmt: skip
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(weights(eager), weights(graphed), f"step {i} weights after the update")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp", "transformer_layer"])
def test_graphed_fp8_weights_match_eager(kind, recipe_name):
    device, recipe = cuda_device(), make_recipe(recipe_name)
    eager, graphed = build(kind, recipe, device), build(kind, recipe, device)
    assert any(isinstance(p, QuantizedTensor) for p in graphed.parameters())
    sample = torch.randn(SEQ, BATCH, HIDDEN, device=device, dtype=DTYPE, requires_grad=True)
    make_graphed_callables(graphed, (sample,), enabled=True, recipe=recipe)
    compare(eager, graphed, recipe, device)


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed"])
def test_graphed_transformer_layer_with_a_padding_mask_keyword(recipe_name):
    """The mask is a static keyword input: each replay copies the call's mask in."""
    device, recipe = cuda_device(), make_recipe(recipe_name)

    def layer():
        torch.manual_seed(1234)
        return te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                   self_attn_mask_type="padding", params_dtype=DTYPE,
                                   device=device)  # fmt: skip

    def mask(lengths) -> torch.Tensor:  # [b, 1, 1, s], True where a position is padding
        positions = torch.arange(SEQ, device=device)
        return (positions[None, :] >= torch.tensor(lengths, device=device)[:, None])[:, None, None]

    eager, graphed = layer(), layer()
    sample = torch.randn(SEQ, BATCH, HIDDEN, device=device, dtype=DTYPE, requires_grad=True)
    make_graphed_callables(graphed, (sample,), sample_kwargs={"attention_mask": mask([SEQ, 20])},
                           enabled=recipe is not None, recipe=recipe)  # fmt: skip
    enabled = recipe is not None
    for i, ((x, dy), lengths) in enumerate(zip(data(device), ([SEQ, 9], [17, SEQ], [5, 30]))):
        m = mask(lengths)
        outs = []
        for model in (eager, graphed):
            xi = x.clone().requires_grad_(True)
            with te.autocast(enabled=enabled, recipe=recipe):
                y = model(xi, attention_mask=m)
            y.backward(dy)
            outs.append([y.detach().clone(), xi.grad.clone()])
        assert_same(outs[0], outs[1], f"step {i}")
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
