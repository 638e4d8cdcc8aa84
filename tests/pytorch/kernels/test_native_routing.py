"""What the wrappers hand the native binding, checked on CPU with a recording stand-in.

On a GPU the kernels receive (data_ptr, shape, dtype code) tuples, the tensor's device index and
that device's current stream; these tests pin that contract (argument order, which buffer goes
where, dtype codes) for every entry point, including the prevalidated ones the quantizers, the
linear core and the amax registry use, without needing a GPU.
"""

import types

import pytest
import torch

from transformer_engine.pytorch.constants import TE_DType
from transformer_engine.pytorch.cpp_extensions import cast, scaling
from transformer_engine.pytorch.cpp_extensions.cast import (
    AMAX_WORKSPACE_ELEMENTS,
    DBIAS_TILE_ROWS,
    quantize,
    quantize_current_scaling_prevalidated,
    quantize_dbias_prevalidated,
    quantize_prevalidated,
)
from transformer_engine.pytorch.cpp_extensions.scaling import (
    compute_scale_from_amax,
    current_scale_prevalidated,
    delayed_scaling_update,
    delayed_scaling_update_prevalidated,
)

DEVICE_AND_STREAM = (3, 0xABC)


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def record(name):
        return lambda *args: calls.append((name, args))

    fake = types.SimpleNamespace(
        **{n: record(n) for n in ("quantize", "quantize_dbias", "dequantize", "compute_amax",
                                   "compute_scale_from_amax", "delayed_scaling_update",
                                   "quantize_current_scaling", "compute_current_scale")}
    )  # fmt: skip
    for module in (cast, scaling):
        monkeypatch.setattr(module, "native_for", lambda op, device: fake)
        monkeypatch.setattr(module, "launch_args", lambda device: DEVICE_AND_STREAM)
    return calls


def arg(t):
    return (t.data_ptr(), tuple(t.shape), int(TE_DType[t.dtype]))


@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_and_its_prevalidated_twin_pass_the_same_contract(recorder, with_transpose):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    scale, amax = torch.ones(1), torch.zeros(1)
    public = quantize(x, scale, torch.float8_e5m2, amax=amax, with_transpose=with_transpose)
    fast = quantize_prevalidated(
        x, scale, torch.float8_e5m2, amax=amax, with_transpose=with_transpose
    )
    for result, (name, args) in zip((public, fast), recorder):
        assert name == "quantize"
        inp, sc, out, out_t, am, scale_inv, noop, device, stream = args
        assert inp == arg(x) and sc == arg(scale) and am == arg(amax)
        assert out == arg(result.data.view(torch.float8_e5m2))
        assert out[2] == int(TE_DType[torch.float8_e5m2])
        assert scale_inv == arg(result.scale_inv)
        assert noop is None
        assert (device, stream) == DEVICE_AND_STREAM
        if with_transpose:
            assert out_t == arg(result.transpose.view(torch.float8_e5m2))
            assert out_t[1] == (32, 4)
        else:
            assert out_t is None and result.transpose is None


def test_prevalidated_quantize_still_refuses_state_on_another_device(recorder):
    with pytest.raises(ValueError, match="meta"):
        quantize_prevalidated(
            torch.ones(2, 16), torch.ones(1, device="meta"), torch.float8_e4m3fn, amax=None,
            with_transpose=False,
        )  # fmt: skip
    assert recorder == []


def test_scale_and_update_entries(recorder):
    amax, out = torch.tensor([2.0]), torch.empty(1)
    compute_scale_from_amax(
        amax, torch.float8_e4m3fn, epsilon=0.5, force_pow_2_scales=True, out=out
    )
    histories, scales = [torch.zeros(3, 2), torch.zeros(3, 1)], [torch.ones(2), torch.ones(1)]
    reduced = torch.ones(3)
    delayed_scaling_update(histories, scales, torch.float8_e5m2, margin=1.5,
                           amax_compute_algo="most_recent", amax_reduction_buffer=reduced)  # fmt: skip
    delayed_scaling_update_prevalidated(
        histories, scales, torch.float8_e5m2, 1.5, "most_recent", reduced
    )
    (name, args), *updates = recorder
    assert name == "compute_scale_from_amax"
    assert args == (arg(amax), arg(out), int(TE_DType[torch.float8_e4m3fn]), 0.5, True,
                    *DEVICE_AND_STREAM)  # fmt: skip
    assert len(updates) == 2 and updates[0] == updates[1]
    name, (buf, hs, ss, algo_max, code, margin, device, stream) = updates[0]
    assert name == "delayed_scaling_update"
    assert (
        buf == arg(reduced) and hs == [arg(h) for h in histories] and ss == [arg(s) for s in scales]
    )
    assert (algo_max, code, margin) == (False, int(TE_DType[torch.float8_e5m2]), 1.5)
    assert (device, stream) == DEVICE_AND_STREAM


def test_current_scale_prevalidated_runs_amax_reduce_then_scale(recorder):
    x = torch.randn(8, 32, dtype=torch.float16)
    reduced = []
    scale = current_scale_prevalidated(
        x, torch.float8_e5m2, epsilon=0.25, force_pow_2_scales=True, reduce_amax=reduced.append
    )
    (amax_name, amax_args), (scale_name, scale_args) = recorder
    assert amax_name == "compute_amax" and scale_name == "compute_scale_from_amax"
    inp, amax_out, *launch = amax_args
    assert inp == arg(x) and tuple(amax_out[1:]) == ((1,), int(TE_DType[torch.float32]))
    assert tuple(launch) == DEVICE_AND_STREAM
    # the scale kernel reads the amax buffer the amax kernel wrote (after the reduction)
    assert scale_args == (amax_out, arg(scale), int(TE_DType[torch.float8_e5m2]), 0.25, True,
                          *DEVICE_AND_STREAM)  # fmt: skip
    assert len(reduced) == 1 and reduced[0].data_ptr() == amax_out[0]


@pytest.mark.parametrize("with_noop", [False, True])
def test_current_scale_prevalidated_without_reduction_is_one_native_call(recorder, with_noop):
    x = torch.randn(8, 32, dtype=torch.float16)
    noop = torch.ones(1) if with_noop else None
    scale = current_scale_prevalidated(
        x, torch.float8_e5m2, epsilon=0.25, force_pow_2_scales=True, noop_flag=noop
    )
    ((name, args),) = recorder
    assert name == "compute_current_scale"
    inp, amax, sc, code, eps, pow2, maxima, noop_arg, *launch = args
    assert inp == arg(x) and sc == arg(scale) and noop_arg == (None if noop is None else arg(noop))
    assert (code, eps, pow2) == (int(TE_DType[torch.float8_e5m2]), 0.25, True)
    assert tuple(launch) == DEVICE_AND_STREAM
    # the amax, the scale, then the per-block maxima: consecutive slots of one scratch buffer
    assert amax[1:] == sc[1:] == ((1,), F32_CODE) and sc[0] == amax[0] + 4
    assert maxima == (amax[0] + 8, (AMAX_WORKSPACE_ELEMENTS,), F32_CODE)


def test_quantize_dbias_hands_every_buffer_and_a_tile_sized_workspace(recorder):
    x = torch.randn(3, 65, 32, dtype=torch.bfloat16)  # 195 rows: 4 tiles of 64
    scale, amax = torch.ones(1), torch.zeros(1)
    result, dbias = quantize_dbias_prevalidated(x, scale, torch.float8_e4m3fn, amax=amax)
    ((name, args),) = recorder
    assert name == "quantize_dbias"
    inp, sc, out, out_t, am, scale_inv, db, workspace, device, stream = args
    assert inp == arg(x) and sc == arg(scale) and am == arg(amax)
    assert out == arg(result.data) and out_t == arg(result.transpose) and out_t[1] == (32, 3, 65)
    assert scale_inv == arg(result.scale_inv)
    assert db == arg(dbias) and db[1:] == ((32,), int(TE_DType[torch.bfloat16]))
    assert workspace[1:] == ((4 * 32,), int(TE_DType[torch.float32]))
    assert (device, stream) == DEVICE_AND_STREAM


F32_CODE = int(TE_DType[torch.float32])


@pytest.mark.parametrize(
    "with_transpose, with_dbias", [(False, False), (True, False), (True, True)]
)
def test_current_scaling_cast_is_one_native_call(recorder, with_transpose, with_dbias):
    x = torch.randn(3, 65, 32, dtype=torch.bfloat16)  # 195 rows: 4 tiles of 64
    result, dbias = quantize_current_scaling_prevalidated(
        x, torch.float8_e5m2, epsilon=0.25, force_pow_2_scales=True,
        with_transpose=with_transpose, with_dbias=with_dbias,
    )  # fmt: skip
    ((name, args),) = recorder
    assert name == "quantize_current_scaling"
    inp, out, out_t, amax, scale, scale_inv, eps, pow2, db, workspace, *launch, maxima = args
    assert inp == arg(x) and out == arg(result.data) and scale_inv == arg(result.scale_inv)
    assert out[2] == int(TE_DType[torch.float8_e5m2])
    assert (eps, pow2, tuple(launch)) == (0.25, True, DEVICE_AND_STREAM)
    # the amax pass's per-block maxima, the amax and the scale: consecutive float32 slots of one
    # scratch buffer, after the dbias workspace
    assert maxima[1:] == ((AMAX_WORKSPACE_ELEMENTS,), F32_CODE)
    assert amax[1:] == scale[1:] == ((1,), F32_CODE) and scale[0] == amax[0] + 4
    assert amax[0] == maxima[0] + 4 * AMAX_WORKSPACE_ELEMENTS
    if with_transpose:
        assert out_t == arg(result.transpose) and out_t[1] == (32, 3, 65)
    else:
        assert out_t is None and result.transpose is None
    if with_dbias:
        assert db == arg(dbias) and db[1:] == ((32,), int(TE_DType[torch.bfloat16]))
        tiles = -(-195 // DBIAS_TILE_ROWS)
        assert workspace[1:] == ((tiles * 32,), F32_CODE)
        assert maxima[0] == workspace[0] + 4 * tiles * 32
    else:
        assert db is None and workspace is None and dbias is None


@pytest.mark.parametrize("with_amax_reduction", [False, True])
def test_current_scaling_quantizer_fuses_unless_it_reduces_the_amax(
    recorder, monkeypatch, with_amax_reduction
):
    from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer

    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **kw: reduced.append(t))
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, with_amax_reduction=with_amax_reduction)
    q.internal = True
    q.quantize_impl(torch.randn(64, 32, dtype=torch.bfloat16))
    q.quantize_with_dbias_impl(torch.randn(64, 32, dtype=torch.bfloat16))
    names = [name for name, _ in recorder]
    if with_amax_reduction:  # the all-reduce runs between the amax and the scale kernels
        assert names == ["compute_amax", "compute_scale_from_amax", "quantize"] + [
            "compute_amax", "compute_scale_from_amax", "quantize_dbias"]  # fmt: skip
        assert len(reduced) == 2
    else:
        assert names == ["quantize_current_scaling"] * 2 and reduced == []
        assert recorder[1][1][8] is not None  # the second call made the bias gradient


def test_current_scaling_update_quantized_skips_its_amax_pass_with_the_cast(recorder):
    """Under a no-op flag (a CUDA graph's cached weight) the amax pass takes the cast's flag."""
    from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    dst = q.make_empty((64, 32), dtype=torch.bfloat16, device="cpu")
    flag = torch.ones(1)
    q.update_quantized(torch.randn(64, 32, dtype=torch.bfloat16), dst, noop_flag=flag)
    assert [name for name, _ in recorder] == ["compute_current_scale", "quantize"]
    assert all(arg(flag) in args for _, args in recorder)
