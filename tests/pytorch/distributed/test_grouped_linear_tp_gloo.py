"""Tensor-parallel ``te.GroupedLinear``: a column -> row expert MLP over 2 gloo processes held to
the single-process model (run_grouped_linear_tp.py), and, in one process, the local shards,
partition attributes and the refusals upstream has (bias under TP, sizes that do not divide, a
forward without a group). NCCL variant: two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from utils import needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_grouped_linear_tp as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_parallel_grouped_linear_equals_the_single_process_model(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES))


def test_local_shards_and_partition_attributes():
    col = te.GroupedLinear(2, 32, 64, bias=False, tp_size=2, parallel_mode="column", device="cpu")
    row = te.GroupedLinear(2, 64, 32, bias=False, tp_size=2, parallel_mode="row",
                           sequence_parallel=True, device="cpu")  # fmt: skip
    for i in range(2):
        assert getattr(col, f"weight{i}").shape == (32, 32)
        assert getattr(row, f"weight{i}").shape == (32, 32)
        assert getattr(col, f"weight{i}").partition_dim == 0
        assert getattr(row, f"weight{i}").partition_dim == 1
        assert getattr(col, f"weight{i}").tensor_model_parallel is True
    assert (col.out_features, col.in_features, row.in_features) == (32, 32, 32)
    assert (col.tp_size, row.sequence_parallel, col.sequence_parallel) == (2, True, False)
    # One rank: the whole layer; a column-parallel bias is partitioned along dim 0.
    single = te.GroupedLinear(2, 32, 64, parallel_mode="column", device="cpu")
    assert single.weight0.shape == (64, 32) and single.bias0.partition_dim == 0
    assert (
        te.GroupedLinear(2, 32, 64, sequence_parallel=True, device="cpu").sequence_parallel is False
    )


def test_meta_init_keeps_the_local_shard_and_attributes():
    m = te.GroupedLinear(2, 32, 64, bias=False, tp_size=2, parallel_mode="column", device="meta")
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert m.weight1.shape == (32, 32) and m.weight1.partition_dim == 0


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(tp_size=2, parallel_mode="column"), ValueError, "bias=True with tp_size=2"),
        (dict(tp_size=2, bias=False, parallel_mode="row", in_features=33), ValueError,
         "in_features=33 is not divisible"),
        (dict(tp_size=2, bias=False, parallel_mode="column", out_features=31), ValueError,
         "out_features=31 is not divisible"),
        (dict(parallel_mode="diagonal"), ValueError, "parallel_mode='diagonal'"),
        (dict(tp_size=0), ValueError, "tp_size=0"),
    ],
)  # fmt: skip
def test_refused_arguments(kwargs, error, text):
    sizes = dict(in_features=32, out_features=64)
    sizes.update({k: kwargs.pop(k) for k in list(kwargs) if k in sizes})
    with pytest.raises(error, match=text):
        te.GroupedLinear(2, sizes["in_features"], sizes["out_features"], device="cpu", **kwargs)


def test_forward_without_a_group_is_refused():
    m = te.GroupedLinear(2, 32, 64, bias=False, tp_size=2, parallel_mode="column", device="cpu")
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        m(torch.randn(32, 32), [16, 16])


def test_sequence_parallel_needs_no_reduce_amax_here():
    """GroupedLinear gathers nothing, so DelayedScaling(reduce_amax=False) is not refused under
    sequence parallelism with one rank's group (tp_size 1 makes SP ineffective anyway)."""
    m = te.GroupedLinear(2, 32, 32, bias=False, sequence_parallel=True, device="cpu")
    with te.autocast(recipe=DelayedScaling(reduce_amax=False)):
        out = m(torch.randn(32, 32), [16, 16])
    assert out.shape == (32, 32)


@needs_two_gpus
def test_parallel_grouped_linear_over_nccl(tmp_path):
    run_torchrun("run_grouped_linear_tp.py", tmp_path)
