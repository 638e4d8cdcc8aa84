"""``te.make_graphed_callables`` on the attention stack and the fusible ops: a graphed
``te.TransformerLayer``, ``te.MultiheadAttention``, ``te.DotProductAttention`` and
``te.ops.Sequential`` against the same modules run eagerly.

The oracle is the eager module built from the same seed: over several training steps with SGD
updates, outputs, input gradients, parameter gradients and FP8 state must be bit for bit the
same (a replay runs the kernels the eager step runs; the sequences are short enough that the
attention kernels' backward accumulates each gradient element in one block, so eager runs are
themselves reproducible). With dropout, the graph draws new masks at each replay, the ones an
eager run from the same seed draws.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import DTYPE, assert_same, cuda_device, fp8_state, sgd
from utils import make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.graph import make_graphed_callables

SEQ, BATCH, HIDDEN, HEADS, FFN = 32, 2, 128, 4, 256
STEPS = 4


def build(kind: str, device, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(1234)
    kw = dict(params_dtype=DTYPE, device=device)
    if kind == "transformer_layer":
        return te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=dropout,
                                   attention_dropout=dropout, **kw)  # fmt: skip
    if kind == "mha":
        return te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=dropout, **kw)
    if kind == "dpa":
        return te.DotProductAttention(HEADS, HIDDEN // HEADS, attention_dropout=dropout)
    return ops.Sequential(
        ops.LayerNorm(HIDDEN, device=device, dtype=DTYPE),
        ops.Linear(HIDDEN, FFN, device=device, dtype=DTYPE),
        ops.GELU(),
        ops.Linear(FFN, HIDDEN, device=device, dtype=DTYPE),
    )


def shapes(kind: str) -> list:
    """The inputs' shapes: q, k, v for attention alone, one sequence-first hidden state else."""
    if kind == "dpa":
        return [(SEQ, BATCH, HEADS, HIDDEN // HEADS)] * 3
    return [(SEQ, BATCH, HIDDEN)]


def samples(kind: str, device) -> tuple:
    return tuple(
        torch.randn(s, device=device, dtype=DTYPE, requires_grad=True) for s in shapes(kind)
    )


def data(kind: str, device, steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        xs = [torch.randn(s, generator=g).to(device, DTYPE) for s in shapes(kind)]
        out.append(
            (xs, torch.randn(shapes(kind)[0][:2] + (HIDDEN,), generator=g).to(device, DTYPE))
        )
    return out


def step(model, xs, dy, recipe) -> list:
    xs = [x.clone().requires_grad_(True) for x in xs]
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(*xs)
    y.backward(dy.reshape(y.shape))
    return [y.detach().clone()] + [x.grad.clone() for x in xs]


def graphed_and_eager(kind, recipe, dropout=0.0):
    device = cuda_device()
    eager, graphed = build(kind, device, dropout), build(kind, device, dropout)
    make_graphed_callables(
        graphed, samples(kind, device), enabled=recipe is not None, recipe=recipe
    )
    return eager, graphed


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed", "current"])
@pytest.mark.parametrize("kind", ["transformer_layer", "mha", "dpa", "ops"])
def test_graphed_layer_matches_eager(kind, recipe_name):
    recipe = make_recipe(recipe_name)
    eager, graphed = graphed_and_eager(kind, recipe)
    for i, (xs, dy) in enumerate(data(kind, cuda_device())):
        assert_same(step(eager, xs, dy, recipe), step(graphed, xs, dy, recipe), f"step {i}")
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed"])
def test_graphed_transformer_layer_with_dropout_draws_the_eager_masks(recipe_name):
    """Hidden and attention dropout inside the graphs: every replay draws new masks (the
    outputs of two replays of one input differ), and they are the masks an eager run from the
    same seed draws."""
    recipe = make_recipe(recipe_name)
    eager, graphed = graphed_and_eager("transformer_layer", recipe, dropout=0.25)
    batches = data("transformer_layer", cuda_device())
    torch.manual_seed(7)
    graphed_steps = [step(graphed, xs, dy, recipe) for xs, dy in batches]
    torch.manual_seed(7)
    eager_steps = [step(eager, xs, dy, recipe) for xs, dy in batches]
    for i, (a, b) in enumerate(zip(eager_steps, graphed_steps)):
        assert_same(a, b, f"step {i}")
    xs, dy = batches[0]
    again = step(graphed, xs, dy, recipe)[0]
    assert not torch.equal(again, graphed_steps[0][0]), "a replay reused the last masks"


@needs_cuda
@pytest.mark.filterwarnings("ignore:.*FP8 attention")
@pytest.mark.parametrize("recipe_cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("kind", ["transformer_layer", "dpa"])
def test_graphed_fp8_attention_matches_eager(kind, recipe_cls):
    """``fp8_dpa=True``: attention's own FP8 emulation (its scales, amaxes and casts) inside
    the graphs, as the eager module runs it."""
    recipe = recipe_cls(fp8_dpa=True)
    eager, graphed = graphed_and_eager(kind, recipe)
    for i, (xs, dy) in enumerate(data(kind, cuda_device())):
        assert_same(step(eager, xs, dy, recipe), step(graphed, xs, dy, recipe), f"step {i}")
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")
