"""``FP8GlobalStateManager.set_skip_fp8_weight_update_tensor`` / ``get_skip_fp8_weight_update_tensor``:
one float32 flag per device (upstream keeps one process-wide tensor on whichever device was
current first), read by weight casts as their ``noop_flag``.

Oracle for the casts: the bytes of a fresh quantization of the same values.
"""

from __future__ import annotations

import pytest
import torch
from utils import needs_cuda, needs_two_gpus

from transformer_engine.pytorch.quantization import FP8GlobalStateManager as M
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer


@pytest.fixture(autouse=True)
def _fresh_state():
    M.reset()
    yield
    M.reset()


def _current_device() -> torch.device:
    # Written out here rather than taken from the package's device seam.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def test_unset_is_none_and_set_makes_one_float32_flag():
    assert M.get_skip_fp8_weight_update_tensor() is None
    M.set_skip_fp8_weight_update_tensor(True)
    flag = M.get_skip_fp8_weight_update_tensor()
    assert flag.shape == (1,) and flag.dtype == torch.float32
    assert flag.device == _current_device()
    assert flag.tolist() == [1.0]
    M.set_skip_fp8_weight_update_tensor(False)
    # the same memory is rewritten: a captured graph that reads it sees the new value
    assert M.get_skip_fp8_weight_update_tensor() is flag and flag.tolist() == [0.0]
    M.reset()
    assert M.get_skip_fp8_weight_update_tensor() is None


def test_flags_are_per_device():
    M.set_skip_fp8_weight_update_tensor(True, device="cpu")
    assert M.get_skip_fp8_weight_update_tensor(device="meta") is None
    M.set_skip_fp8_weight_update_tensor(False, device="meta")
    assert M.get_skip_fp8_weight_update_tensor(device="cpu").tolist() == [1.0]
    assert M.get_skip_fp8_weight_update_tensor(device="meta").device.type == "meta"


def test_bad_arguments_name_the_value():
    with pytest.raises(TypeError, match="skip=0.5"):
        M.set_skip_fp8_weight_update_tensor(0.5)
    with pytest.raises(TypeError, match="skip=2"):
        M.set_skip_fp8_weight_update_tensor(2)
    with pytest.raises(ValueError, match="names no CUDA index"):
        M.set_skip_fp8_weight_update_tensor(True, device="cuda")
    with pytest.raises(ValueError, match="names no CUDA index"):
        M.get_skip_fp8_weight_update_tensor(device="cuda")


def _check_flag_drives_the_weight_cast(device):
    torch.manual_seed(0)
    q = Float8Quantizer(
        scale=torch.full((1,), 4.0, device=device),
        amax=torch.zeros(1, device=device),
        fp8_dtype=torch.float8_e4m3fn,
    )
    old, new = (torch.randn(32, 32, device=device) for _ in range(2))
    w = q.quantize(old)
    old_bytes = w._data.clone()
    new_bytes = q.quantize(new)._data
    assert not torch.equal(old_bytes.view(torch.uint8), new_bytes.view(torch.uint8))

    M.set_skip_fp8_weight_update_tensor(True, device=device)
    q.update_quantized(new, w, noop_flag=M.get_skip_fp8_weight_update_tensor(device=device))
    assert torch.equal(w._data.view(torch.uint8), old_bytes.view(torch.uint8))
    M.set_skip_fp8_weight_update_tensor(False, device=device)
    q.update_quantized(new, w, noop_flag=M.get_skip_fp8_weight_update_tensor(device=device))
    assert torch.equal(w._data.view(torch.uint8), new_bytes.view(torch.uint8))


def test_flag_drives_the_weight_cast_cpu():
    _check_flag_drives_the_weight_cast(torch.device("cpu"))


@needs_cuda
def test_flag_drives_the_weight_cast_gpu():
    _check_flag_drives_the_weight_cast(torch.device("cuda", torch.cuda.current_device()))


@needs_two_gpus
def test_each_current_device_gets_its_own_flag():
    """Upstream's flag lives on the device current at its first use; here setting it while
    cuda:1 is current makes cuda:1's flag, and cuda:0's stays separate."""
    with torch.cuda.device(1):
        M.set_skip_fp8_weight_update_tensor(True)
        flag1 = M.get_skip_fp8_weight_update_tensor()
    with torch.cuda.device(0):
        assert M.get_skip_fp8_weight_update_tensor() is None
        M.set_skip_fp8_weight_update_tensor(False)
        flag0 = M.get_skip_fp8_weight_update_tensor()
    assert flag1.device == torch.device("cuda", 1) and flag0.device == torch.device("cuda", 0)
    assert (flag1.tolist(), flag0.tolist()) == ([1.0], [0.0])
    _check_flag_drives_the_weight_cast(torch.device("cuda", 1))
