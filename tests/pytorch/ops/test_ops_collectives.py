"""The collective operations (AllReduce, AllGather, ReduceScatter).

Real 2-process gloo runs (torch.multiprocessing.spawn, file:// rendezvous), run once for the
module; each check compares forward values and backward gradients with the analytic results,
alone and inside te.ops.Sequential with BasicLinear (row-parallel with AllReduce or
ReduceScatter, column-parallel after AllGather). The same checks over NCCL need two GPUs and
are skipped without them.
"""

import math
import os
import tempfile
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

# ------------------------------------------------------------------------------------------
# Collectives: single process


def test_collectives_need_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for op in (ops.AllReduce(), ops.AllGather(), ops.ReduceScatter()):
        with pytest.raises(RuntimeError, match="not initialized"):
            op(torch.randn(4, 4))


def test_collectives_with_one_rank_are_the_identity(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for op in (ops.AllReduce(), ops.AllGather(), ops.ReduceScatter()):
            x = torch.randn(3, 4, requires_grad=True)
            y = op(x)
            dy = torch.randn(3, 4)
            y.backward(dy)
            assert torch.equal(y, x) and torch.equal(x.grad, dy), type(op).__name__
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Collectives: two processes

WORLD = 2


def _rank_tensor(rank, *shape, salt=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * salt + rank))


def _all_ranks(*shape, salt=0):
    return [_rank_tensor(r, *shape, salt=salt) for r in range(WORLD)]


def _exact(actual, expected):
    """Collectives move and sum values: equal up to the summation order."""
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-6, atol=1e-6)


def _gemm_close(actual, expected):
    """A float32 GEMM result against float64."""
    assert_close_by_table(actual.cpu(), expected, ("same_values", torch.float32))


def check_all_reduce(rank, device):
    for reduce_in_backward in (True, False):
        x = _rank_tensor(rank, 3, 5, salt=1).to(device).requires_grad_()
        x_before = x.detach().clone()
        y = ops.AllReduce(reduce_in_backward=reduce_in_backward)(x)
        dy = _rank_tensor(rank, 3, 5, salt=2).to(device)
        y.backward(dy)
        assert y.device == device and x.grad.device == device
        _exact(y, sum(_all_ranks(3, 5, salt=1)))
        assert torch.equal(x.detach(), x_before)  # the input is not written
        expected_dx = sum(_all_ranks(3, 5, salt=2)) if reduce_in_backward else dy.cpu()
        _exact(x.grad, expected_dx)


def check_all_gather(rank, device):
    x = _rank_tensor(rank, 3, 2, 5, salt=3).to(device).requires_grad_()
    y = ops.AllGather()(x)
    dy = _rank_tensor(rank, 6, 2, 5, salt=4).to(device)
    y.backward(dy)
    assert y.shape == (6, 2, 5) and y.device == device
    _exact(y, torch.cat(_all_ranks(3, 2, 5, salt=3)))
    _exact(x.grad, sum(_all_ranks(6, 2, 5, salt=4))[3 * rank : 3 * rank + 3])


def check_reduce_scatter(rank, device):
    x = _rank_tensor(rank, 4, 5, salt=5).to(device).requires_grad_()
    y = ops.ReduceScatter()(x)
    dy = _rank_tensor(rank, 2, 5, salt=6).to(device)
    y.backward(dy)
    assert y.shape == (2, 5) and y.device == device
    _exact(y, sum(_all_ranks(4, 5, salt=5))[2 * rank : 2 * rank + 2])
    _exact(x.grad, torch.cat(_all_ranks(2, 5, salt=6)))
    try:  # raised on every rank before any communication
        ops.ReduceScatter()(torch.randn(3, 5, device=device))
    except ValueError as error:
        assert "divisible" in str(error)
    else:
        raise AssertionError("an indivisible first dimension was accepted")


T, H, N = 32, 64, 32  # tokens, input features, output features of the full layer


def _full_layer():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(N, H, generator=g) / math.sqrt(H)
    b = torch.randn(N, generator=g)
    dy = torch.randn(T, N, generator=g)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    (F.linear(xr, wr, br)).backward(dy.double())
    return x, w, b, dy, F.linear(xr, wr, br).detach(), xr.grad, wr.grad, br.grad


def _block(t, rank, dim):
    return t.chunk(WORLD, dim=dim)[rank]


def check_row_parallel_all_reduce(rank, device, recipe=None):
    """BasicLinear on this rank's input columns, AllReduce (no reduction in backward: the
    Bias and the loss are replicated), then Bias: the full layer's values and gradients."""
    x, w, b, dy, y_ref, dx_ref, dw_ref, db_ref = _full_layer()
    linear = ops.BasicLinear(H // WORLD, N, device=device)
    bias = ops.Bias(N, device=device)
    with torch.no_grad():
        linear.weight.copy_(_block(w, rank, 1))
        bias.bias.copy_(b)
    model = ops.Sequential(linear, ops.AllReduce(reduce_in_backward=False), bias)
    x_local = _block(x, rank, 1).to(device).requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x_local)
    y.backward(dy.to(device))
    assert y.device == device and linear.weight.grad.device == device

    def close(actual, expected, fp8_key):
        if recipe is None:
            _gemm_close(actual, expected)
        else:
            assert_close_by_table(actual.cpu(), expected, (fp8_key, torch.float32))

    close(y, y_ref.float(), "e4m3")
    close(x_local.grad, _block(dx_ref, rank, 1).float(), "hybrid")
    close(linear.weight.grad, _block(dw_ref, rank, 1).float(), "hybrid")
    _exact(bias.bias.grad, db_ref.float())


def check_row_parallel_all_reduce_fp8(rank, device):
    check_row_parallel_all_reduce(rank, device, recipe=Float8CurrentScaling())


def check_row_parallel_reduce_scatter(rank, device):
    """Sequence-parallel row-parallel layer: BasicLinear on this rank's input columns, then
    ReduceScatter gives this rank its rows of the full output."""
    x, w, b, dy, y_ref, dx_ref, dw_ref, _ = _full_layer()
    y_ref = y_ref - b.double()
    linear = ops.BasicLinear(H // WORLD, N, device=device)
    with torch.no_grad():
        linear.weight.copy_(_block(w, rank, 1))
    model = ops.Sequential(linear, ops.ReduceScatter())
    x_local = _block(x, rank, 1).to(device).requires_grad_()
    y = model(x_local)
    y.backward(_block(dy, rank, 0).to(device))
    _gemm_close(y, _block(y_ref, rank, 0).float())
    _gemm_close(x_local.grad, _block(dx_ref, rank, 1).float())
    _gemm_close(linear.weight.grad, _block(dw_ref, rank, 1).float())


def check_column_parallel_all_gather(rank, device):
    """Sequence-parallel column-parallel layer: AllGather of this rank's rows, then
    BasicLinear with this rank's output features (and its bias block)."""
    x, w, b, dy, y_ref, dx_ref, dw_ref, db_ref = _full_layer()
    linear = ops.BasicLinear(H, N // WORLD, device=device)
    bias = ops.Bias(N // WORLD, device=device)
    with torch.no_grad():
        linear.weight.copy_(_block(w, rank, 0))
        bias.bias.copy_(_block(b, rank, 0))
    model = ops.Sequential(ops.AllGather(), linear, bias)
    x_local = _block(x, rank, 0).to(device).requires_grad_()
    y = model(x_local)
    y.backward(_block(dy, rank, 1).to(device))
    _gemm_close(y, _block(y_ref, rank, 1).float())
    _gemm_close(x_local.grad, _block(dx_ref, rank, 0).float())
    _gemm_close(linear.weight.grad, _block(dw_ref, rank, 0).float())
    _exact(bias.bias.grad, _block(db_ref, rank, 0).float())


CHECKS = {
    f.__name__[len("check_") :]: f
    for f in (
        check_all_reduce,
        check_all_gather,
        check_reduce_scatter,
        check_row_parallel_all_reduce,
        check_row_parallel_all_reduce_fp8,
        check_row_parallel_reduce_scatter,
        check_column_parallel_all_gather,
    )
}


def _worker(rank, backend, init_file, out_dir):
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # NCCL's process device; the library never asks
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    results = {}
    try:
        for name, check in CHECKS.items():
            FP8GlobalStateManager.reset()
            try:
                check(rank, device)
                results[name] = None
            except Exception:  # reported per check by the pytest side
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _run(backend):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(backend, os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def gloo_results():
    return _run("gloo")


@pytest.mark.parametrize("check", list(CHECKS))
def test_collectives_over_two_gloo_processes(gloo_results, check):
    for rank, results in enumerate(gloo_results):
        assert results[check] is None, f"rank {rank}:\n{results[check]}"


@pytest.fixture(scope="module")
def nccl_results():
    return _run("nccl")


@needs_two_gpus
@pytest.mark.parametrize("check", list(CHECKS))
def test_gpu_collectives_over_two_nccl_processes(nccl_results, check):
    for rank, results in enumerate(nccl_results):
        assert results[check] is None, f"rank {rank}:\n{results[check]}"
