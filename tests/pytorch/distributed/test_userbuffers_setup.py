"""Which collectives a module's ``ub_*`` flags pipeline (upstream's rules, by parallel mode),
and the setup's refusals that need no process group. The pipelines themselves run in
test_comm_gemm_overlap_gloo.py."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch._userbuffers import comm_overlap_flags
from transformer_engine.pytorch.module.base import get_ub

ALL = dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True,
           ub_bulk_dgrad=True, ub_bulk_wgrad=True)  # fmt: skip


def flags(mode, sp=True, **kw):
    f = comm_overlap_flags("Layer", parallel_mode=mode, sequence_parallel=sp, ub_name="x", **kw)
    return None if f is None else (f.ag_fprop, f.rs_fprop, f.rs_dgrad, f.ag_dgrad)


def test_each_flag_acts_on_its_side_of_the_pair():
    # (forward gather, forward reduce-scatter, backward reduce-scatter, backward gather)
    assert flags("column", **ALL) == (True, False, True, False)
    assert flags("row", **ALL) == (False, True, False, True)
    assert flags("mlp", **ALL) == (True, True, True, True)
    assert flags("column", ub_overlap_ag=True) == (True, False, False, False)
    assert flags("row", ub_overlap_ag=True) == (False, False, False, True)
    assert flags("row", ub_overlap_rs_dgrad=True) is None  # a row layer has no such collective
    # the bulk overlaps are what every column backward does already: nothing to switch on
    assert flags("column", ub_bulk_dgrad=True, ub_bulk_wgrad=True) is None


def test_flags_act_only_under_tensor_and_sequence_parallelism():
    assert flags("column", sp=False, **ALL) is None
    assert flags(None, **ALL) is None


def test_a_flag_needs_the_layer_name():
    with pytest.raises(ValueError, match="need ub_name"):
        comm_overlap_flags("Linear", parallel_mode="column", sequence_parallel=True,
                           ub_overlap_ag=True)  # fmt: skip
    assert te.Linear(32, 32, ub_name="qkv", device="cpu").comm_overlap is None


def test_setup_needs_torch_distributed():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        te.initialize_ub([64, 32], 1)
    with pytest.raises(RuntimeError, match="initialize_ub"):
        get_ub("qkv_fprop")
    te.destroy_ub()  # nothing to undo: a no-op
    assert te.UserBufferQuantizationMode("fp8") is te.UserBufferQuantizationMode.FP8
