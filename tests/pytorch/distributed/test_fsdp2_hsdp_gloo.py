"""HSDP (FSDP2 over a 2 x 2 mesh: replicate x shard), 4 processes on gloo (CPU), with FP8
weights from ``quantized_model_init``: each weight is all-gathered in FP8 over its shard group
and its amax all-reduced over that group, and training equals the unsharded single-process run
(each rank's slice fed in turn, the gradients divided by 4): losses and FP8 weights (values and
scales) bitwise; the high-precision biases to the last bits only, since a sum of four
gradients depends on the order HSDP's reduce-scatter and all-reduce take. Also from ``meta``:
the resets write into the shards and set up their quantizers over the mesh's shard dimension."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_fsdp2 as harness  # noqa: E402

WORLD_SIZE, STEPS = 4, 3
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}
# (recipe, built on meta: fully_shard on meta, to_empty, reset_parameters())
RUNS = [("delayed", False), ("current", False), ("current", True)]


def _model(recipe_name, device="cpu"):
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=RECIPES[recipe_name]()):
        return torch.nn.Sequential(
            te.Linear(32, 64, device=device), te.Linear(64, 32, device=device)
        )


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8 * WORLD_SIZE, 32, generator=g) for _ in range(STEPS)]


def _worker(rank, out_dir, init_file):
    harness.gloo_worker(
        rank, out_dir, init_file, (2, 2), partial(_train, rank), ("replicate", "shard")
    )


def _train(rank, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    results = {}
    for recipe_name, meta in RUNS:
        recipe = RECIPES[recipe_name]()
        model = _model(recipe_name, "meta" if meta else "cpu")
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if meta:  # the resets write into the shards (and set up their quantizers)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            for block in model:
                block.reset_parameters()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = harness.rank_steps(
            model, optimizer, _batches(), rank, WORLD_SIZE, partial(te.autocast, recipe=recipe)
        )
        key = f"{recipe_name}-meta" if meta else recipe_name
        results[key] = {"losses": losses, "params": harness.full_parameters(model)}
    return results


def _reference(recipe_name):
    model = _model(recipe_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = harness.oracle_steps(
        model, optimizer, [x.chunk(WORLD_SIZE) for x in _batches()],
        lambda: te.autocast(recipe=RECIPES[recipe_name]()), WORLD_SIZE,
    )  # fmt: skip
    return losses, harness.full_parameters(model)


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp")
    mp.spawn(_worker, args=(str(out), str(out / "init")), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("recipe_name,meta", RUNS, ids=[f"{r}{'-meta' * m}" for r, m in RUNS])
def test_hsdp_fp8_weights_train_like_the_unsharded_run(sharded_results, recipe_name, meta):
    losses, params = _reference(recipe_name)
    assert sum(k.endswith("._scale_inv") for k in params) == 2
    key = f"{recipe_name}-meta" if meta else recipe_name
    harness.check_ranks_equal_oracle(sharded_results, key, losses, params, atol=1e-10)
