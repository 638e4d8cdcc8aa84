"""nvte_quantize_current_scaling (one native call: amax -> scale -> cast [+ transpose, + dbias])
against the three calls it replaces, bit for bit, and its device contract.

Runs on a CUDA machine (qa/L0_pytorch_gpu/test.sh); skipped elsewhere with that reason.
"""

import pytest
import torch
from utils import cpu_bytes, needs_cuda, needs_two_gpus

import transformer_engine
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.constants import TE_DType
from transformer_engine.pytorch.cpp_extensions.cast import (
    quantize_current_scaling_prevalidated,
    quantize_dbias_prevalidated,
    quantize_prevalidated,
)
from transformer_engine.pytorch.cpp_extensions.scaling import current_scale_prevalidated

pytestmark = needs_cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
HIGH = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (17, 33), (255, 17), (3, 17, 65), (128, 4097), (256, 1024), (0, 32)]
SCALING = [(0.0, False), (0.5, True), (1e4, False)]  # (epsilon, force_pow_2_scales)


def make_input(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 30
    if x.numel() >= 4:
        x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -6e4, 1e-30])
    return x.to(dtype).to(device)


def composed(x, fp8, epsilon, pow2, with_transpose, with_dbias):
    scale = current_scale_prevalidated(x, fp8, epsilon=epsilon, force_pow_2_scales=pow2)
    if with_dbias:
        return quantize_dbias_prevalidated(x, scale, fp8, amax=None)
    return quantize_prevalidated(x, scale, fp8, amax=None, with_transpose=with_transpose), None


def assert_same(fused, plain):
    (res, dbias), (res_p, dbias_p) = fused, plain
    assert torch.equal(cpu_bytes(res.data), cpu_bytes(res_p.data))
    assert torch.equal(cpu_bytes(res.scale_inv), cpu_bytes(res_p.scale_inv))
    if res_p.transpose is None:
        assert res.transpose is None
    else:
        assert torch.equal(cpu_bytes(res.transpose), cpu_bytes(res_p.transpose))
    if dbias_p is not None:
        assert torch.equal(cpu_bytes(dbias), cpu_bytes(dbias_p))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("epsilon, pow2", SCALING)
@pytest.mark.parametrize("with_transpose", [False, True])
def test_one_call_gives_the_bits_of_amax_scale_and_cast(shape, dtype, fp8, epsilon, pow2,
                                                        with_transpose):  # fmt: skip
    x = make_input(shape, dtype, "cuda:0", seed=shape[-1])
    fused = quantize_current_scaling_prevalidated(
        x, fp8, epsilon=epsilon, force_pow_2_scales=pow2, with_transpose=with_transpose,
        with_dbias=False,
    )  # fmt: skip
    assert_same(fused, composed(x, fp8, epsilon, pow2, with_transpose, False))
    # and the CPU reference: scale from the amax, then the cast
    scale = reference.compute_scale_from_amax(reference.amax(x.cpu()), fp8, epsilon, pow2)
    expected = reference.cast_to_fp8(x.cpu(), scale, fp8)
    assert torch.equal(cpu_bytes(fused[0].data), cpu_bytes(expected))


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] > 0])
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("fp8", FP8)
def test_one_call_with_dbias_gives_the_bits_of_the_composed_cast(shape, dtype, fp8):
    x = make_input(shape, dtype, "cuda:0", seed=7)
    x.view(-1)[:4] = 1.5  # finite: the bias gradient is compared bit for bit
    fused = quantize_current_scaling_prevalidated(
        x, fp8, epsilon=0.0, force_pow_2_scales=False, with_transpose=True, with_dbias=True
    )
    assert fused[1].shape == (shape[-1],) and fused[1].dtype == dtype
    assert_same(fused, composed(x, fp8, 0.0, False, True, True))


def _arg(t):
    return (t.data_ptr(), list(t.shape), int(TE_DType[t.dtype]))


@pytest.mark.parametrize("shape", [(0, 64), (3, 5), (4096, 4096), (8191, 1031)])
@pytest.mark.parametrize("where", [0, -1])
def test_the_amax_from_per_block_maxima_equals_the_atomic_one(shape, where):
    """With amax_workspace the amax pass writes one maximum per block and the scale kernel
    reduces them (no memset); amax, scale and bytes match the memset + atomics path and the
    CPU reference, with the largest element first or last (the first or the last block)."""
    native = transformer_engine.common.native.native_module()
    x = make_input(shape, torch.bfloat16, "cuda:0", seed=11)
    x.view(-1)[:4] = 1.0
    if x.numel() > 0:
        x.view(-1)[where] = -4096.0
    stream = torch.cuda.current_stream(0).cuda_stream
    fp8 = lambda t: (t.data_ptr(), list(t.shape), int(TE_DType[torch.float8_e4m3fn]))  # noqa: E731
    results = []
    for maxima in (None, torch.full((1024,), 1e30, device="cuda:0")):  # stale slots: wrong amax
        out = torch.empty(shape, dtype=torch.uint8, device="cuda:0")
        amax, scale, scale_inv = (torch.full((1,), 7.0, device="cuda:0") for _ in range(3))
        native.quantize_current_scaling(
            _arg(x), fp8(out), None, _arg(amax), _arg(scale), _arg(scale_inv), 0.0, False, None,
            None, 0, stream, None if maxima is None else _arg(maxima),
        )  # fmt: skip
        results.append((out.cpu(), amax.cpu(), scale.cpu(), scale_inv.cpu()))
    expected_amax = reference.amax(x.cpu()).reshape(1)
    expected_scale = reference.compute_scale_from_amax(
        expected_amax, torch.float8_e4m3fn, 0.0, False
    ).reshape(1)
    for _, amax, scale, _ in results:
        assert torch.equal(cpu_bytes(amax), cpu_bytes(expected_amax))
        assert torch.equal(cpu_bytes(scale), cpu_bytes(expected_scale))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def test_a_refused_call_writes_nothing():
    native = transformer_engine.common.native.native_module()
    x = make_input((64, 32), torch.bfloat16, "cuda:0")
    out = torch.full((64, 32), 7, dtype=torch.uint8, device="cuda:0")
    out_t = torch.full((32, 64), 7, dtype=torch.uint8, device="cuda:0")
    amax, scale, scale_inv = (torch.full((1,), 3.0, device="cuda:0") for _ in range(3))
    short_ws = torch.zeros(1, device="cuda:0")  # needs 32 elements
    dbias = torch.zeros(32, dtype=torch.bfloat16, device="cuda:0")
    fp8 = lambda t: (t.data_ptr(), list(t.shape), int(TE_DType[torch.float8_e4m3fn]))  # noqa: E731
    with pytest.raises(ValueError, match=r"nvte_quantize_current_scaling: workspace has 1"):
        native.quantize_current_scaling(
            _arg(x), fp8(out), fp8(out_t), _arg(amax), _arg(scale), _arg(scale_inv), 0.0, False,
            _arg(dbias), _arg(short_ws), 0, torch.cuda.current_stream(0).cuda_stream,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert (out == 7).all() and (out_t == 7).all() and (dbias == 0).all()
    assert amax.item() == scale.item() == scale_inv.item() == 3.0


@needs_two_gpus
def test_on_cuda1_while_cuda0_is_current():
    torch.cuda.set_device(0)
    x1 = make_input((255, 130), torch.bfloat16, "cuda:1", seed=3)
    x1.view(-1)[:4] = 2.0
    res, dbias = quantize_current_scaling_prevalidated(
        x1, torch.float8_e5m2, epsilon=0.0, force_pow_2_scales=False, with_transpose=True,
        with_dbias=True,
    )  # fmt: skip
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert res.data.device == res.transpose.device == dbias.device == torch.device("cuda:1")
    with torch.cuda.device(1):
        again = quantize_current_scaling_prevalidated(
            x1, torch.float8_e5m2, epsilon=0.0, force_pow_2_scales=False, with_transpose=True,
            with_dbias=True,
        )  # fmt: skip
    assert_same((res, dbias), again)


@needs_two_gpus
def test_a_buffer_on_the_other_gpu_is_refused_before_anything_runs():
    native = transformer_engine.common.native.native_module()
    x = make_input((64, 32), torch.bfloat16, "cuda:0")
    out = torch.full((64, 32), 7, dtype=torch.uint8, device="cuda:1")  # wrong device
    amax, scale = torch.full((1,), 3.0, device="cuda:0"), torch.full((1,), 3.0, device="cuda:0")
    fp8 = (out.data_ptr(), [64, 32], int(TE_DType[torch.float8_e4m3fn]))
    with pytest.raises(RuntimeError, match=r"output is on device 1 but the call runs on device 0"):
        native.quantize_current_scaling(
            _arg(x), fp8, None, _arg(amax), _arg(scale), None, 0.0, False, None, None, 0,
            torch.cuda.current_stream(0).cuda_stream,
        )  # fmt: skip
    torch.cuda.synchronize(0)
    assert amax.item() == scale.item() == 3.0 and (out == 7).all()
