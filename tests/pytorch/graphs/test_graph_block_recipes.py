"""``te.make_graphed_callables`` under the block-scaled recipes (``Float8BlockScaling``,
``MXFP8BlockScaling``, ``NVFP4BlockScaling``; natively or emulated, as the GPU allows): graphed modules
against the same modules run eagerly, bit for bit over several SGD steps, with and without
cached weights (``cache_quantized_params``). The oracle is the eager module built from the same
seed; block-scaled casts keep no state between steps, so outputs and gradients are what can
differ.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import DTYPE, H, assert_same, sgd
from test_make_graphed_callables import build, step
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.pytorch.graph import make_graphed_callables

TOKENS = 128  # the block-scaled casts' block length along the tokens (H: 128 as well)
STEPS = 4
RECIPES = {
    "float8_block": (Float8BlockScaling, te.is_fp8_block_scaling_available),
    "mxfp8": (MXFP8BlockScaling, te.is_mxfp8_available),
    "nvfp4": (NVFP4BlockScaling, te.is_nvfp4_available),
}


def recipe_or_skip(name: str):
    """The recipe; where the GPU has no native GEMM for it (MXFP8 and NVFP4 before Blackwell)
    its GEMMs run by exact emulation, which the graphs capture as well."""
    cls, available = RECIPES[name]
    if not available() and not te.is_fp8_available():
        pytest.skip(f"{name}: this GPU runs no FP8 at all")
    return cls()


def data(device) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(TOKENS, H, generator=g).to(device, DTYPE),
         torch.randn(TOKENS, H, generator=g).to(device, DTYPE))
        for _ in range(STEPS)
    ]  # fmt: skip


def seeded_step(model, x, dy, recipe, seed, **kwargs) -> list:
    torch.manual_seed(seed)  # NVFP4's stochastic rounding draws: the same for both models
    return step(model, x, dy, recipe, **kwargs)


@needs_cuda
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp", "stack"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.filterwarnings("ignore:.*run by exact emulation")
def test_graphed_block_scaled_modules_match_eager(recipe_name, kind, cache):
    recipe = recipe_or_skip(recipe_name)
    if cache and kind == "stack":
        pytest.skip("a Sequential passes no is_first_microbatch; weight caching graphs TE modules")
    device = torch.device("cuda", torch.cuda.current_device())
    eager, graphed = build(kind, device), build(kind, device)
    sample = torch.randn(TOKENS, H, device=device, dtype=DTYPE, requires_grad=True)
    make_graphed_callables(graphed, (sample,), enabled=True, recipe=recipe,
                           cache_quantized_params=cache)  # fmt: skip
    for i, (x, dy) in enumerate(data(device)):
        # with caching: a new weight cast on the first of each two microbatches
        kwargs = {"is_first_microbatch": i % 2 == 0} if cache else {}
        assert_same(seeded_step(eager, x, dy, recipe, i, **kwargs),
                    seeded_step(graphed, x, dy, recipe, i, **kwargs), f"step {i}")  # fmt: skip
        if not cache or i % 2 == 1:  # the weights change only before a new cast
            assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
