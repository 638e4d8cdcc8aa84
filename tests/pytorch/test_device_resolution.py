"""The device contract as every module and operation sees it (``transformer_engine.pytorch.device``).

Expectations are written by hand from the contract: where no device is named parameters go to the
current CUDA device, else the CPU; ``"cuda"`` is pinned to the current index at construction; a
CUDA device where CUDA is missing, and materializing onto ``meta``, are refused with one error
type, ``DevicePlacementError`` (a ``ValueError``), whose message names the owner and the value.

CUDA is switched off with ``monkeypatch`` where a test is about "no CUDA here", so these tests
run (and mean the same) on a GPU machine too; tests that need a real GPU skip with a reason.
"""

from __future__ import annotations

import re

import pytest
import torch
from utils import needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch import device as device_seam
from transformer_engine.pytorch.device import DevicePlacementError

# (owner name expected in messages, constructor taking a device). Sizes are the smallest each
# class accepts; nothing here runs a forward.
MODULES = [
    ("Linear", lambda device: te.Linear(4, 4, device=device)),
    ("LayerNormLinear", lambda device: te.LayerNormLinear(4, 4, device=device)),
    ("LayerNormMLP", lambda device: te.LayerNormMLP(4, 8, device=device)),
    ("GroupedLinear", lambda device: te.GroupedLinear(2, 4, 4, device=device)),
    ("LayerNorm", lambda device: te.LayerNorm(4, device=device)),
    ("RMSNorm", lambda device: te.RMSNorm(4, device=device)),
]
OPS = [
    ("BasicLinear", lambda device: te.ops.BasicLinear(4, 4, device=device)),
    ("Bias", lambda device: te.ops.Bias(4, device=device)),
    ("GroupedLinear", lambda device: te.ops.GroupedLinear(2, 4, 4, device=device)),
    ("LayerNorm", lambda device: te.ops.LayerNorm(4, device=device)),
    ("RMSNorm", lambda device: te.ops.RMSNorm(4, device=device)),
    # te.ops.Linear is a fused op of BasicLinear (+ Bias): the first of them refuses.
    ("BasicLinear", lambda device: te.ops.Linear(4, 4, device=device)),
]
BUILDERS = [pytest.param(*entry, id=f"module-{entry[0]}") for entry in MODULES] + [
    pytest.param(*entry, id=f"op-{entry[0]}") for entry in OPS
]
# Operations whose reset_parameters takes the materialization device.
OPS_WITH_RESET_DEVICE = [pytest.param(*entry, id=entry[0]) for entry in OPS[:5]]


@pytest.fixture
def without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def faked_cuda(monkeypatch):
    """CUDA "available" with current device 3 (nothing may allocate on it)."""
    current = {"index": 3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    return current


def parameters_of(obj) -> list[torch.Tensor]:
    return list(obj.parameters())


# ---------------------------------------------------------------------------------------------
# Every module and operation: construction


@pytest.mark.parametrize("owner, build", BUILDERS)
@pytest.mark.parametrize("requested", ["cuda", "cuda:0", torch.device("cuda")], ids=str)
def test_cuda_without_cuda_is_a_placement_error(without_cuda, owner, build, requested):
    with pytest.raises(DevicePlacementError) as info:
        build(requested)
    message = str(info.value)
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working
    assert message.startswith(f"{owner}: ")
    assert f"device='{torch.device(requested)}'" in message
    assert "CUDA is not available" in message
    assert "device='cpu'" in message and "device='meta'" in message  # the fix


@pytest.mark.parametrize("owner, build", BUILDERS)
def test_message_and_type_equal_across_modules_and_ops(without_cuda, owner, build):
    expected = (
        "device='cuda' was requested but CUDA is not available here; pass device='cpu' (the "
        "reference path) or device='meta' (deferred initialization)"
    )
    with pytest.raises(Exception) as info:
        build("cuda")
    assert type(info.value) is DevicePlacementError
    assert str(info.value) == f"{owner}: {expected}"


@pytest.mark.parametrize("owner, build", BUILDERS)
def test_none_builds_on_cpu_without_cuda(without_cuda, owner, build):
    params = parameters_of(build(None))
    assert params
    assert all(p.device == torch.device("cpu") for p in params)


@pytest.mark.parametrize("owner, build", BUILDERS)
def test_meta_builds_no_storage(owner, build):
    params = parameters_of(build("meta"))
    assert params and all(p.is_meta for p in params)


@pytest.mark.parametrize("owner, build", BUILDERS)
def test_unknown_device_string_is_a_placement_error(owner, build):
    with pytest.raises(DevicePlacementError, match=rf"^{owner}: device='gpu' is not a device"):
        build("gpu")


# ---------------------------------------------------------------------------------------------
# Materialization of meta parameters


@pytest.mark.parametrize("owner, build", OPS_WITH_RESET_DEVICE)
def test_op_refuses_to_materialize_onto_meta(owner, build):
    op = build("meta")
    with pytest.raises(DevicePlacementError, match="cannot materialize parameters onto the meta"):
        op.reset_parameters(device="meta")
    assert all(p.is_meta for p in parameters_of(op))  # nothing half-done


@pytest.mark.parametrize("owner, build", OPS_WITH_RESET_DEVICE)
def test_op_materializes_onto_the_named_device(owner, build):
    op = build("meta")
    op.reset_parameters(device="cpu")
    assert all(p.device == torch.device("cpu") for p in parameters_of(op))


@pytest.mark.parametrize("owner, build", OPS_WITH_RESET_DEVICE)
def test_op_refuses_cuda_materialization_without_cuda(without_cuda, owner, build):
    op = build("meta")
    with pytest.raises(DevicePlacementError, match="device='cuda' was requested but CUDA is not"):
        op.reset_parameters(device="cuda")


@pytest.mark.parametrize("owner, build", BUILDERS)
def test_meta_then_reset_without_device_lands_on_cpu_without_cuda(without_cuda, owner, build):
    built = build("meta")
    built.reset_parameters()
    params = parameters_of(built)
    assert params and all(p.device == torch.device("cpu") for p in params)


def test_materialization_device_rules(without_cuda):
    assert device_seam.materialization_device() == torch.device("cpu")
    assert device_seam.materialization_device("cpu") == torch.device("cpu")
    for meta in ("meta", torch.device("meta")):
        with pytest.raises(DevicePlacementError, match="onto the meta device, which holds no"):
            device_seam.materialization_device(meta)


def test_norm_module_meta_parameters_follow_a_materialized_sibling():
    # Only one of the two parameters has storage (as after a partial to_empty): the other
    # joins it rather than the default device.
    module = te.LayerNorm(4, device="meta")
    module.bias = torch.nn.Parameter(torch.empty(4, dtype=module.weight.dtype))
    module.reset_parameters()
    assert module.weight.device == torch.device("cpu")
    assert torch.equal(module.weight, torch.ones(4))
    assert torch.equal(module.bias, torch.zeros(4))


def test_first_storage_device():
    meta, cpu = torch.empty(1, device="meta"), torch.empty(1)
    assert device_seam.first_storage_device() is None
    assert device_seam.first_storage_device(None, meta) is None
    assert device_seam.first_storage_device(meta, None, cpu) == torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The rules with a (faked) current CUDA device: resolution only, nothing allocates


def test_faked_cuda_resolution(faked_cuda):
    construct = device_seam.construction_device
    assert construct("X", None) == torch.device("cuda", 3)
    assert construct("X", "cuda") == torch.device("cuda", 3)
    assert construct("X", torch.device("cuda")) == torch.device("cuda", 3)
    assert construct("X", "cuda:1") == torch.device("cuda", 1)
    assert construct("X", "cpu") == torch.device("cpu")
    assert construct("X", "meta") == torch.device("meta")
    assert device_seam.materialization_device() == torch.device("cuda", 3)
    assert device_seam.materialization_device("cuda") == torch.device("cuda", 3)
    assert device_seam.materialization_device("cuda:2") == torch.device("cuda", 2)
    assert device_seam.default_device() == torch.device("cuda", 3)


def test_faked_cuda_index_is_pinned_at_resolution(faked_cuda):
    resolved = device_seam.construction_device("X", "cuda")
    faked_cuda["index"] = 5
    assert resolved == torch.device("cuda", 3)
    assert device_seam.construction_device("X", "cuda") == torch.device("cuda", 5)


def test_faked_cuda_modules_on_meta_keep_meta(faked_cuda):
    # "meta" never consults CUDA, whatever is current.
    for _, build in MODULES + OPS:
        assert all(p.is_meta for p in parameters_of(build("meta")))


def test_visible_cuda_devices(without_cuda):
    assert device_seam.visible_cuda_devices() == []


# ---------------------------------------------------------------------------------------------
# The other placement refusals share the type


def test_operands_on_different_devices_are_a_placement_error():
    x, w = torch.empty(2), torch.empty(2, device="meta")
    with pytest.raises(DevicePlacementError) as info:
        device_seam.check_same_device("gemm", "x", x, weight=w)
    assert str(info.value) == (
        "gemm: weight is on meta but x is on cpu; move weight to cpu (the execution device is "
        "the device of x)"
    )


def test_meta_operand_is_a_placement_error():
    with pytest.raises(DevicePlacementError, match=r"^norm: x is a meta tensor and holds no data"):
        device_seam.reject_meta("norm", x=torch.empty(2, device="meta"))


def test_native_launch_on_a_non_cuda_device_is_a_placement_error():
    with pytest.raises(DevicePlacementError, match="native kernels run on an indexed CUDA device"):
        device_seam.native_launch_args(torch.device("cpu"))


def test_module_forward_on_meta_parameters_is_a_value_error():
    module = te.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=re.escape("meta")):
        module(torch.randn(2, 4))


# ---------------------------------------------------------------------------------------------
# Real CUDA


@needs_cuda
@pytest.mark.parametrize("owner, build", BUILDERS)
def test_none_and_cuda_build_on_the_current_cuda_device(owner, build):
    current = torch.device("cuda", torch.cuda.current_device())
    for requested in (None, "cuda"):
        params = parameters_of(build(requested))
        assert params and all(p.device == current for p in params)


@needs_cuda
def test_meta_module_materializes_on_the_current_cuda_device():
    module = te.Linear(4, 4, device="meta")
    module.reset_parameters()
    current = torch.device("cuda", torch.cuda.current_device())
    assert all(p.device == current for p in module.parameters())
