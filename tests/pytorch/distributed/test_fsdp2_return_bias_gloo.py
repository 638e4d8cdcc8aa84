"""Modules built with ``return_bias=True`` (Linear, LayerNormLinear, LayerNormMLP,
GroupedLinear, MultiheadAttention) as FSDP2 units of their own (``fully_shard`` on each,
then on the model that adds their biases), 2 processes on gloo (CPU). FSDP2 frees a unit's
unsharded parameters as soon as its forward returns; the bias handed back for the caller's add
is a copy there, so the add reads the values (the parameter itself had no storage left: the
process crashed) and the gradient reaches the parameter. Training equals the unsharded run
bit for bit, without FP8 and under delayed scaling."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_fsdp2 as harness  # noqa: E402

WORLD_SIZE, STEPS = 2, 3
RECIPES = {"high_precision": None, "delayed": DelayedScaling}


class Model(torch.nn.Module):
    """Each module returns its bias; the model adds it (a later fused add, as Megatron's)."""

    def __init__(self) -> None:
        super().__init__()
        kw = {"device": "cpu", "return_bias": True}
        self.linear = te.Linear(32, 32, **kw)
        self.ln_linear = te.LayerNormLinear(32, 32, **kw)
        self.mlp = te.LayerNormMLP(32, 64, **kw)
        self.grouped = te.GroupedLinear(2, 32, 32, **kw)
        # a unit whose returned bias is its (unwrapped) projection's
        self.attention = te.MultiheadAttention(32, 2, attention_dropout=0.0, **kw)

    def units(self):
        return (self.linear, self.ln_linear, self.mlp, self.grouped, self.attention)

    def forward(self, x):
        for module in (self.linear, self.ln_linear, self.mlp):
            out, bias = module(x)
            x = out + bias
        out, bias = self.attention(x.view(-1, 2, x.shape[-1]))  # [seq, batch, hidden]
        x = (out + bias).view(-1, x.shape[-1])
        outs, biases = self.grouped(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])
        halves = outs.split([x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])
        return torch.cat([h + b for h, b in zip(halves, biases)])


def _model():
    torch.manual_seed(0)
    return Model()


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16 * WORLD_SIZE, 32, generator=g) for _ in range(STEPS)]


def _autocast(recipe_name):
    recipe = RECIPES[recipe_name]
    return te.autocast(enabled=recipe is not None, recipe=recipe and recipe())


def _worker(rank, out_dir, init_file):
    harness.gloo_worker(rank, out_dir, init_file, (WORLD_SIZE,), partial(_train, rank))


def _train(rank, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    results = {}
    for recipe_name in RECIPES:
        model = _model()
        for unit in model.units():
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = harness.rank_steps(
            model, optimizer, _batches(), rank, WORLD_SIZE, partial(_autocast, recipe_name)
        )
        results[recipe_name] = {"losses": losses, "params": harness.full_parameters(model)}
    return results


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_return_bias")
    mp.spawn(_worker, args=(str(out), str(out / "init")), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_returned_biases_of_fsdp2_units_train_like_the_unsharded_run(sharded_results, recipe_name):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = harness.oracle_steps(
        model, optimizer, [x.chunk(WORLD_SIZE) for x in _batches()],
        lambda: _autocast(recipe_name), WORLD_SIZE,
    )  # fmt: skip
    params = harness.full_parameters(model)
    harness.check_ranks_equal_oracle(sharded_results, recipe_name, losses, params)


def test_an_unwrapped_module_returns_its_bias_parameter_itself():
    """Outside FSDP2 the bias is handed back as it is (no copy a step), as upstream's."""
    module = te.Linear(32, 32, device="cpu", return_bias=True)
    _, bias = module(torch.randn(4, 32))
    assert bias is module.bias
