"""The block-scaled GEMM's binding and host-side checks (``nvte_block_scaled_gemm``), without a GPU.

Needs the native library (built by ``pip install .`` wherever nvcc exists); the argument checks
run before cuBLASLt is loaded or any CUDA call is made, so each bad argument is refused with a
message naming it on any machine. The GPU products are in test_block_scaled_gemm_gpu.py.
"""

import pytest
import torch

import transformer_engine
from transformer_engine.common.native import native_module
from transformer_engine.pytorch.constants import DType

native = native_module()
pytestmark = pytest.mark.skipif(
    native is None or not hasattr(native, "block_scaled_gemm"),
    reason=f"native library not built here ({transformer_engine.native_status().reason})",
)

F32, BF16, F16 = int(DType.kFloat32), int(DType.kBFloat16), int(DType.kFloat16)
E4M3, BYTE = int(DType.kFloat8E4M3), int(DType.kByte)
FAKE = 4096  # a 16-byte-aligned non-null pointer value; never dereferenced


def gemm(x=(FAKE, [256, 512], E4M3), xs=(FAKE, [4, 256], F32), x2d=False,
         y=(FAKE, [128, 512], E4M3), ys=(FAKE, [1, 4], F32), y2d=True, bias=None,
         out=(FAKE, [256, 128], BF16), workspace=None):  # fmt: skip
    """A valid fprop-shaped call (x 1x128 [256, 512], y 128x128 [128, 512]) unless overridden."""
    return native.block_scaled_gemm(x, xs, x2d, y, ys, y2d, bias, out, workspace, 0, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(x2d=True, xs=(FAKE, [2, 4], F32)), r"both operands have 128x128 blocks"),
        (dict(x=(FAKE, [256, 512], BF16)),
         r"x has dtype BFloat16; expected one of Float8E4M3, Float8E5M2"),
        (dict(x=(FAKE, [2, 128, 512], E4M3)), r"x must be 2-D \[rows, K\], got 3 dimensions"),
        (dict(xs=(FAKE, [4, 255], F32)),
         r"x_scale_inv must be \[4, 256\] for 1x128 scales of a \[256, 512\] operand, got \[4, 255\]"),
        (dict(ys=(FAKE, [1, 3], F32)),
         r"y_scale_inv must be \[1, 4\] for 128x128 scales of a \[128, 512\] operand"),
        (dict(ys=(FAKE, [1, 4], BF16)), r"y_scale_inv has dtype BFloat16; expected one of Float32"),
        (dict(x=(FAKE + 8, [256, 512], E4M3)), r"x and x_scale_inv must be 16-byte aligned"),
        (dict(y=(FAKE, [128, 640], E4M3), ys=(FAKE, [1, 8], F32)),
         r"x is \[256, 512\] but y is \[128, 640\]: the inner \(K\) extents differ"),
        (dict(x=(FAKE, [256, 100], E4M3), xs=(FAKE, [0, 256], F32), y=(FAKE, [128, 100], E4M3),
              ys=(FAKE, [1, 0], F32)),
         r"M=256, N=128, K=100: M and N must be positive and K a positive multiple of 128"),
        (dict(out=(FAKE, [256, 128], E4M3)), r"out has dtype Float8E4M3"),
        (dict(out=(FAKE, [128, 256], BF16)), r"out must be \[256, 128\]"),
        (dict(y=(FAKE, [120, 512], E4M3), out=(FAKE, [256, 120], BF16)),
         r"N=120: out's rows must be 16-element multiples"),
        (dict(bias=(FAKE, [128], F16)),
         r"bias must hold N=128 16-byte-aligned elements of out's dtype BFloat16, got 128 of Float16"),
        (dict(bias=(FAKE, [128], F32), out=(FAKE, [256, 128], F32)), r"bias has dtype Float32"),
        (dict(workspace=(FAKE, [1024], F32)), r"workspace has dtype Float32"),
        (dict(workspace=(FAKE + 16, [1024], BYTE)), r"workspace must be 256-byte aligned"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_with_a_message_naming_them(kwargs, message):
    with pytest.raises(ValueError, match="nvte_block_scaled_gemm: " + message):
        gemm(**kwargs)


def test_cublaslt_version_never_throws():
    version = native.cublaslt_version()
    assert isinstance(version, int)
    assert version == 0 or version >= 120900


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without a GPU")
def test_valid_arguments_without_a_gpu_fail_cleanly():
    # No cuBLASLt here (PyTorch's CPU build brings none), or, where one is installed, no driver.
    with pytest.raises(RuntimeError, match=r"nvte_block_scaled_gemm: (libcublasLt|cudaGetDevice)"):
        gemm()
