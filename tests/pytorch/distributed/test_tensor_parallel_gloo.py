"""Tensor and sequence parallelism over 2 gloo processes on the CPU (run_tensor_parallel.py holds
the model comparisons and derives their tolerances), the ``te.distributed`` collectives' semantics
against hand-computed results, and the construction / forward errors. NCCL variants need two
GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from utils import needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.pytorch import distributed as ted

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_tensor_parallel as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_parallel_models_equal_the_single_process_model(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES))


# --- the collectives ---------------------------------------------------------------------------


def _collectives(rank, world_size, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank
        out, handle = ted.gather_along_first_dim(x, group)
        assert handle is None
        want = torch.cat([torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(3, 2) + 10])
        assert torch.equal(out, want)
        out, handle = ted.gather_along_first_dim(x, group, async_op=True)
        handle.wait()
        assert torch.equal(out, want)
        y = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
        rs, _ = ted.reduce_scatter_along_first_dim(y, group)
        full = torch.arange(8.0).reshape(4, 2) * 3  # (1 + 2) times the values
        assert torch.equal(rs, full[2 * rank : 2 * rank + 2])
        with _raises(ValueError, "divisible"):
            ted.reduce_scatter_along_first_dim(torch.ones(3, 2), group)
        z = torch.full((2,), float(rank + 1))
        same, _ = ted.allreduce(z, group)
        assert same is z and torch.equal(z, torch.full((2,), 3.0))
        assert ted.get_distributed_world_size(group) == 2
        assert ted.get_distributed_rank(group) == rank
        Path(out_file + f".{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


class _raises:
    def __init__(self, kind, text):
        self.kind, self.text = kind, text

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        assert kind is not None and issubclass(kind, self.kind), f"expected {self.kind}"
        assert self.text in str(exc), str(exc)
        return True


def test_collectives_over_two_processes(tmp_path):
    out = str(tmp_path / "done")
    mp.spawn(_collectives, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    assert all(Path(f"{out}.{r}").read_text() == "ok" for r in range(2))


def test_helpers_without_torch_distributed():
    x = torch.randn(4, 3)
    assert ted.gather_along_first_dim(x, None) == (x, None)
    assert ted.reduce_scatter_along_first_dim(x, None) == (x, None)
    assert ted.allreduce(x) == (x, None)
    assert ted.get_distributed_world_size() == 1 and ted.get_distributed_rank() == 0
    t = torch.nn.Parameter(torch.empty(2))
    ted.set_tensor_model_parallel_attributes(t, True, 0, 1)
    assert (t.tensor_model_parallel, t.partition_dim, t.partition_stride) == (True, 0, 1)
    with pytest.raises(RuntimeError, match="already has tensor_model_parallel"):
        ted.set_tensor_model_parallel_attributes(t, True, 1, 1)


def test_initialize_affine_weight_gpu_draws_inside_the_tracker_fork():
    """Megatron-LM's helper: the shard is filled inside ``tracker.fork()`` (the values of a
    generator seeded with the tracker's seed; the default generator untouched) and marked.
    The tracker forks the current CUDA device's generator (the CPU's without CUDA), so the
    weight lives there."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    get_state = torch.cuda.get_rng_state if torch.cuda.is_available() else torch.get_rng_state
    tracker = ted.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    weight = torch.nn.Parameter(torch.empty(6, 4, device=device))
    default_state = get_state()
    ted.initialize_affine_weight_gpu(
        weight, torch.nn.init.normal_, lambda: tracker, partition_dim=1, stride=1
    )
    assert torch.equal(get_state(), default_state)
    generator = torch.Generator(device=device).manual_seed(1234)
    expected = torch.empty(6, 4, device=device).normal_(generator=generator)
    assert torch.equal(weight.detach(), expected)
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (
        True, 1, 1,
    )  # fmt: skip
    plain = torch.empty(3)
    ted.initialize_affine_weight_gpu(plain, torch.nn.init.ones_, None, set_tp_attributes=False)
    assert torch.equal(plain, torch.ones(3)) and not hasattr(plain, "partition_dim")
    with pytest.raises(TypeError, match="init_method must be callable"):
        ted.initialize_affine_weight_gpu(plain, None, None, set_tp_attributes=False)


# --- construction: local shards, attributes, initialization, errors ---------------------------


def test_local_shards_and_partition_attributes():
    col = te.Linear(32, 64, tp_size=2, parallel_mode="column", device="cpu")
    row = te.Linear(64, 32, tp_size=2, parallel_mode="row", sequence_parallel=True, device="cpu")
    assert col.weight.shape == (32, 32) and col.bias.shape == (32,)
    assert (col.weight.partition_dim, col.bias.partition_dim) == (0, 0)
    assert row.weight.shape == (32, 32) and row.bias.shape == (32,)
    assert row.weight.partition_dim == 1 and row.bias.sequence_parallel is True
    assert (col.out_features, row.in_features) == (32, 32)
    mlp = te.LayerNormMLP(32, 64, tp_size=2, device="cpu")  # divided even without set_parallel_mode
    assert mlp.fc1_weight.shape == (32, 32) and mlp.fc2_weight.shape == (32, 32)
    lnl = te.LayerNormLinear(32, 64, tp_size=2, parallel_mode="column", sequence_parallel=True,
                             device="cpu")  # fmt: skip
    assert lnl.weight.shape == (32, 32) and lnl.layer_norm_weight.sequence_parallel is True


def test_meta_init_materializes_the_local_shard_with_its_attributes():
    m = te.Linear(32, 64, tp_size=2, parallel_mode="column", device="meta")
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert m.weight.device.type == "cpu" and m.weight.shape == (32, 32)
    assert m.weight.partition_dim == 0 and m.bias.tensor_model_parallel is True


def test_weight_init_runs_inside_the_rng_tracker_fork():
    calls = []

    class Tracker:
        def fork(self, name="model-parallel-rng"):
            calls.append(name)
            return torch.random.fork_rng()

    shapes = []
    m = te.Linear(32, 64, tp_size=2, parallel_mode="column", device="cpu",
                  get_rng_state_tracker=Tracker, init_method=lambda w: shapes.append(w.shape))  # fmt: skip
    assert calls and shapes == [torch.Size([32, 32])]
    del m


@pytest.mark.parametrize(
    "build, error, text",
    [
        (lambda: te.Linear(32, 33, tp_size=2, parallel_mode="column", device="cpu"),
         ValueError, "out_features=33 is not divisible by tp_size=2"),
        (lambda: te.Linear(33, 32, tp_size=2, parallel_mode="row", device="cpu"),
         ValueError, "in_features=33 is not divisible by tp_size=2"),
        (lambda: te.Linear(32, 64, tp_size=2, parallel_mode="column", device="cpu",
                           parameters_split={"a": 33, "b": 31}),
         RuntimeError, "parameters_split['a']=33"),
        (lambda: te.LayerNormLinear(32, 32, tp_size=2, parallel_mode="row", device="cpu"),
         NotImplementedError, "parallel_mode='row'"),
        (lambda: te.Linear(32, 32, tp_size=0, device="cpu"), ValueError, "tp_size=0"),
        (lambda: te.Linear(32, 32, parallel_mode="diagonal", device="cpu"),
         ValueError, "parallel_mode='diagonal'"),
    ],
)  # fmt: skip
def test_bad_tensor_parallel_arguments(build, error, text):
    with pytest.raises(error) as info:
        build()
    assert text in str(info.value)


def test_forward_without_a_group_is_refused_until_one_is_set():
    m = te.Linear(32, 64, tp_size=2, parallel_mode="column", device="cpu")
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        m(torch.randn(4, 32))
    m.set_tensor_parallel_group(None)  # torch.distributed is not initialized: 1 rank
    with pytest.raises(RuntimeError, match="group has 1 rank"):
        m(torch.randn(4, 32))


# --- NCCL (2 GPUs) --------------------------------------------------------------------------------


@needs_two_gpus
def test_parallel_models_over_nccl(tmp_path):
    run_torchrun("run_tensor_parallel.py", tmp_path)
