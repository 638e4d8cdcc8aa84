"""Which block-scaled GEMMs go to the native cuBLASLt call, and with what arguments, on any
machine: the native module is replaced by a recorder (the products themselves are held to a
float64 oracle on the GPU, kernels/test_block_scaled_gemm_gpu.py)."""

import types

import pytest
import torch

from transformer_engine.pytorch.cpp_extensions import block_gemm
from transformer_engine.pytorch.cpp_extensions._fp8_padding import zero_padded_fp8
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

E4M3 = torch.float8_e4m3fn


class Recorder:
    def __init__(self, runs=True, version=130100):
        self.calls, self.runs, self.version = [], runs, version

    def cublaslt_version(self):
        return self.version

    def block_scaled_gemm(self, *args):
        self.calls.append(args)
        return self.runs


@pytest.fixture
def native(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(block_gemm, "native_module", lambda: recorder)
    monkeypatch.setattr(block_gemm, "launch_args", lambda device: (3, 77))
    monkeypatch.setattr(block_gemm, "_cublaslt_state", [])
    return recorder


def operand(rows, k, two_d):
    q = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False,
                             block_scaling_dim=2 if two_d else 1)  # fmt: skip
    return q(torch.randn(rows, k)).block_float8_gemm_input(False)


def call(x_op, y_op, dtype=torch.bfloat16, bias=None):
    return block_gemm._cublaslt_product(*x_op, *y_op, dtype, bias)


def test_the_call_carries_the_operands_scales_and_fresh_buffers(native):
    x_op, y_op = operand(256, 512, False), operand(384, 512, True)
    bias = torch.randn(384).to(torch.bfloat16)
    out = call(x_op, y_op, bias=bias)
    assert out.shape == (256, 384) and out.dtype == torch.bfloat16
    (args,) = native.calls
    x, xs, x2d, y, ys, y2d, b, o, ws, device, stream = args
    assert x == (x_op[0].data_ptr(), (256, 512), x[2]) and xs[1] == (4, 256) and x2d is False
    assert y[1] == (384, 512) and ys[1] == (3, 4) and y2d is True
    assert b[0] == bias.data_ptr() and o[0] == out.data_ptr() and o[1] == (256, 384)
    assert ws[1] == (block_gemm._WORKSPACE_BYTES,) and (device, stream) == (3, 77)


def test_a_declined_problem_returns_none(native):
    native.runs = False
    assert call(operand(256, 512, False), operand(384, 512, True)) is None
    assert len(native.calls) == 1


@pytest.mark.parametrize(
    "x_shape, y_shape, why",
    [
        ((256, 512, True), (384, 512, True), "both 128x128"),
        ((256, 512, False), (120, 512, True), "N not a multiple of 16"),
    ],
)
def test_problems_it_does_not_take_never_reach_it(native, x_shape, y_shape, why):
    assert call(operand(*x_shape), operand(*y_shape)) is None, why
    assert not native.calls


def test_scales_in_another_layout_never_reach_it(native):
    x, xs, x2d = operand(256, 512, False)
    assert call((x, xs[:, :255], x2d), operand(384, 512, True)) is None
    assert call((x, xs.t().contiguous().t(), x2d), operand(384, 512, True)) is None
    assert not native.calls


def test_a_misaligned_bias_is_copied_first(native):
    storage = torch.randn(400).to(torch.bfloat16)
    bias = storage[1:385]  # 2 bytes past the allocation's start
    call(operand(256, 512, False), operand(384, 512, True), bias=bias)
    (args,) = native.calls
    assert args[6][0] % 16 == 0 and args[6][0] != bias.data_ptr()


def test_without_a_usable_cublaslt_nothing_is_called(native):
    native.version = 0
    assert call(operand(256, 512, False), operand(384, 512, True)) is None
    assert not native.calls


def test_a_native_build_without_the_gemm_is_not_usable(monkeypatch):
    monkeypatch.setattr(block_gemm, "native_module", lambda: types.SimpleNamespace())
    monkeypatch.setattr(block_gemm, "_cublaslt_state", [])
    assert call(operand(256, 512, False), operand(384, 512, True)) is None


@pytest.mark.parametrize("m, k", [(130, 512), (1, 128), (256, 300), (7, 200)])
def test_other_token_counts_and_depths_run_on_zero_padded_copies(native, m, k):
    # cuBLASLt takes M % 4 == 0 and K % 128 == 0: the operands reach it padded with zeros, the
    # scales as they are (they cover the padding already), and the product is cut back to M rows.
    x_op, y_op = operand(m, k, False), operand(384, k, True)
    out = call(x_op, y_op)
    assert out.shape == (m, 384)
    (args,) = native.calls
    rows, depth = -(-m // 4) * 4, -(-k // 128) * 128
    assert args[0][1] == (rows, depth) and args[3][1] == (384, depth) and args[7][1] == (rows, 384)
    assert args[1][1] == x_op[1].shape and args[4][1] == y_op[1].shape


@pytest.mark.parametrize("m, k", [(130, 512), (7, 200)])
def test_the_zero_padded_operands_have_the_same_product(m, k):
    # The padded problem, multiplied by the exact emulation, equals the original's product.
    (x, xs, x2d), (y, ys, y2d) = operand(m, k, False), operand(384, k, True)
    rows, depth = -(-m // 4) * 4, -(-k // 128) * 128
    xp, yp = zero_padded_fp8(x, rows, depth), zero_padded_fp8(y, 384, depth)
    assert torch.equal(xp[:m, :k].view(torch.uint8), x.view(torch.uint8))
    assert not xp[m:].view(torch.uint8).any() and not xp[:, k:].view(torch.uint8).any()
    padded = block_gemm._emulated_product(xp, xs, x2d, yp, ys, y2d)[:m]
    original = block_gemm._emulated_product(x, xs, x2d, y, ys, y2d)
    assert torch.allclose(padded, original, rtol=1e-6, atol=1e-6 * float(original.abs().max()))
