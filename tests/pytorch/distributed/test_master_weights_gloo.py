"""tensor.utils.quantize_master_weights: FP8 parameters from sharded master weights, on one
process and with the shards split over 2 gloo processes (CPU), the bytes then all-gathered as a
distributed optimizer would. Oracle: the whole master cast by hand in float32 (rounded to the
parameter's dtype first, scaled, saturated to E4M3), with the scale the recipe state holds
(delayed scaling) or 448 / amax of the whole master (current scaling)."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.tensor.utils import (
    cast_master_weights_to_fp8,
    post_all_gather_processing,
    quantize_master_weights,
)

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
SHAPES = [(16, 32), (24, 8)]
WORLD = 2


def _model(recipe_name, device="cpu"):
    torch.manual_seed(11)
    with te.quantized_model_init(enabled=True, recipe=RECIPES[recipe_name]()):
        layers = [te.Linear(k, n, params_dtype=torch.bfloat16, device=device) for n, k in SHAPES]
    weights = [layer.weight for layer in layers]
    if recipe_name == "delayed":
        for w, s in zip(weights, (2.0, 0.5)):
            w._quantizer.scale.fill_(s)  # a scale the recipe state could hold
    return weights


def _masters(device="cpu"):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(shape, generator=gen) * 3).to(device) for shape in SHAPES]


def _expected_bytes(master, scale):
    values = master.cpu().to(torch.bfloat16).float() * scale
    return values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _expected(recipe_name, weights, masters):
    """(bytes, scale) of each weight cast from its whole master."""
    out = []
    for w, m in zip(weights, masters):
        if recipe_name == "delayed":
            scale = w._quantizer.scale.float().reshape(()).cpu()
        else:
            scale = torch.tensor(448.0) / m.cpu().to(torch.bfloat16).float().abs().max()
        out.append((_expected_bytes(m, scale), scale))
    return out


def _check(recipe_name, weights, masters, amax_before=None):
    for i, (w, (data, scale)) in enumerate(zip(weights, _expected(recipe_name, weights, masters))):
        assert torch.equal(w._data.cpu(), data), f"weight {i}: bytes differ"
        assert torch.equal(w._scale_inv.cpu(), torch.reciprocal(scale).reshape(1))
        # the transposed copy is made again from the new bytes
        assert w._transpose is not None and torch.equal(w._transpose.cpu(), data.t().contiguous())
        if amax_before is not None:
            whole = masters[i].cpu().to(torch.bfloat16).float().abs().max()
            amax = w._quantizer.amax.reshape(()).cpu()
            assert torch.equal(amax, torch.maximum(amax_before[i].cpu(), whole))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_one_process_whole_masters(recipe_name, device):
    weights, masters = _model(recipe_name, device), _masters(device)
    amax_before = None
    if recipe_name == "delayed":
        amax_before = [w._quantizer.amax.clone().reshape(()) for w in weights]
    for w in weights:
        w.float8_gemm_input(columnwise=True)  # a GEMM's cached view of the transposed copy
    old = [weakref.ref(w._transpose) for w in weights if w._transpose is not None]
    assert old or device == "cuda"  # the CPU (like Hopper) keeps transposed copies
    quantize_master_weights(weights, masters, [0, 0], None)
    assert all(w._transpose is None for w in weights)  # stale until made again
    gc.collect()
    assert all(ref() is None for ref in old)  # the stale copies are freed, views and all
    post_all_gather_processing(weights)
    _check(recipe_name, weights, masters, amax_before)


def test_deprecated_name_and_bad_arguments():
    weights, masters = _model("current"), _masters()
    with pytest.warns(DeprecationWarning, match="quantize_master_weights"):
        cast_master_weights_to_fp8(weights, masters, [0, 0], None)
    with pytest.raises(ValueError, match="does not fit"):
        quantize_master_weights(weights[:1], [masters[0]], [10], None)
    with pytest.raises(ValueError, match="equally long"):
        quantize_master_weights(weights, masters[:1], [0, 0], None)
    with pytest.raises(TypeError, match="per-tensor FP8 parameters"):
        quantize_master_weights([torch.zeros(3)], [torch.zeros(3)], [0], None)


def _worker(rank, recipe_name, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        weights, masters = _model(recipe_name), _masters()
        amax_before = None
        if recipe_name == "delayed":
            amax_before = [w._quantizer.amax.clone().reshape(()) for w in weights]
        # Shard boundaries that cut through rows; rank 1 holds none of the second weight.
        cuts = [(0, 200, 512), (0, 192, 192)]
        mine, offsets = [], []
        for m, (a, b, c) in zip(masters, cuts):
            lo, hi = (a, b) if rank == 0 else (b, c)
            flat = m.reshape(-1)
            mine.append(flat[lo:hi].clone() if hi > lo else None)
            offsets.append(lo if hi > lo else None)
        quantize_master_weights(weights, mine, offsets, dist.group.WORLD)
        # the all-gather of the bytes: every rank contributes its shard
        for w, (a, b, c) in zip(weights, cuts):
            lo, hi = (a, b) if rank == 0 else (b, c)
            full = torch.zeros(w._data.numel(), dtype=torch.int32)
            full[lo:hi] = w._data.reshape(-1)[lo:hi].to(torch.int32)
            dist.all_reduce(full)
            w._data.copy_(full.to(torch.uint8).reshape(w._data.shape))
        post_all_gather_processing(weights)
        _check(recipe_name, weights, masters, amax_before)
        torch.save("ok", f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_shards_over_two_processes(tmp_path, recipe_name):
    mp.spawn(
        _worker,
        args=(recipe_name, str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    assert all(torch.load(tmp_path / f"rank{r}.pt") == "ok" for r in range(WORLD))
