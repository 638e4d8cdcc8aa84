"""The pybind11 binding and the C ABI's host-side checks, without launching anything.

These need the native library (built by `pip install .` wherever nvcc exists, GPU or not) but
no GPU: argument checks run before any CUDA call, and on a machine without a driver the first
CUDA call fails with a clear error instead of crashing.
"""

import pytest
import torch

import transformer_engine
from transformer_engine.common.native import native_module
from transformer_engine.pytorch.constants import DType

native = native_module()
pytestmark = pytest.mark.skipif(
    native is None,
    reason=f"native library not built here ({transformer_engine.native_status().reason})",
)

F32, BF16, E4M3 = int(DType.kFloat32), int(DType.kBFloat16), int(DType.kFloat8E4M3)
FAKE = 4096  # a non-null pointer value; never dereferenced because the checks refuse first


def test_version_matches_the_package():
    assert native.version() == transformer_engine.__version__
    assert native.cuda_runtime_version() >= 12080


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: native.quantize((FAKE, [4], 2), (FAKE, [1], F32), (FAKE, [4], E4M3), None, None,
                                 None, None, 0, 0),
         r"nvte_quantize: input has dtype Int32; expected one of Float32, Float16, BFloat16"),
        (lambda: native.quantize((FAKE, [4], BF16), (FAKE, [1], F32), (FAKE, [5], E4M3), None,
                                 None, None, None, 0, 0),
         r"nvte_quantize: output has 5 elements but input has 4"),
        (lambda: native.quantize((FAKE, [2, 4], BF16), (FAKE, [2], F32), (FAKE, [2, 4], E4M3),
                                 None, None, None, None, 0, 0),
         r"nvte_quantize: scale must hold exactly one Float32 element, got 2"),
        (lambda: native.quantize((FAKE, [2, 4], BF16), (FAKE, [1], F32), (FAKE, [2, 4], E4M3),
                                 (FAKE, [2, 4], E4M3), None, None, None, 0, 0),
         r"output_t must have the input's last extent \(4\) as its first extent"),
        (lambda: native.quantize((0, [4], BF16), (FAKE, [1], F32), (FAKE, [4], E4M3), None, None,
                                 None, None, 0, 0),
         r"input has 4 elements but a null data pointer"),
        (lambda: native.quantize_dbias((FAKE, [2, 4], BF16), (FAKE, [1], F32),
                                       (FAKE, [2, 4], E4M3), (FAKE, [4, 2], E4M3), None, None,
                                       (FAKE, [4], F32), (FAKE, [4], F32), 0, 0),
         r"nvte_quantize_dbias: dbias has dtype Float32 but input has BFloat16"),
        (lambda: native.quantize_dbias((FAKE, [2, 4], BF16), (FAKE, [1], F32),
                                       (FAKE, [2, 4], E4M3), (FAKE, [4, 2], E4M3), None, None,
                                       (FAKE, [3], BF16), (FAKE, [4], F32), 0, 0),
         r"dbias must have shape \[4\]"),
        (lambda: native.quantize_dbias((FAKE, [130, 4], BF16), (FAKE, [1], F32),
                                       (FAKE, [130, 4], E4M3), (FAKE, [4, 130], E4M3), None, None,
                                       (FAKE, [4], BF16), (FAKE, [11], F32), 0, 0),
         r"workspace has 11 elements; \[130, 4\] needs nvte_quantize_dbias_workspace_elements = 12"),
        (lambda: native.quantize_dbias((FAKE, [2, 4], BF16), (FAKE, [1], F32),
                                       (FAKE, [2, 4], E4M3), (FAKE, [2, 4], E4M3), None, None,
                                       (FAKE, [4], BF16), (FAKE, [4], F32), 0, 0),
         r"nvte_quantize_dbias: output_t must have the input's last extent \(4\)"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], BF16), None,
                                                 (FAKE, [1], F32), (FAKE, [1], F32), None, 0.0,
                                                 False, None, None, 0, 0),
         r"nvte_quantize_current_scaling: output has dtype BFloat16; expected one of Float8E4M3"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], E4M3), None,
                                                 (FAKE, [2], F32), (FAKE, [1], F32), None, 0.0,
                                                 False, None, None, 0, 0),
         r"nvte_quantize_current_scaling: amax must hold exactly one Float32 element, got 2"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], E4M3), None,
                                                 (FAKE, [1], F32), (FAKE, [1], F32), None,
                                                 float("inf"), False, None, None, 0, 0),
         r"nvte_quantize_current_scaling: epsilon=inf must be a finite number >= 0"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], E4M3), None,
                                                 (FAKE, [1], F32), (FAKE, [1], F32), None, 0.0,
                                                 False, (FAKE, [4], BF16), (FAKE, [4], F32), 0, 0),
         r"nvte_quantize_current_scaling: output_t is required with dbias"),
        (lambda: native.quantize_current_scaling((FAKE, [130, 4], BF16), (FAKE, [130, 4], E4M3),
                                                 (FAKE, [4, 130], E4M3), (FAKE, [1], F32),
                                                 (FAKE, [1], F32), None, 0.0, False,
                                                 (FAKE, [4], BF16), (FAKE, [11], F32), 0, 0),
         r"nvte_quantize_current_scaling: workspace has 11 elements"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], E4M3), None,
                                                 (FAKE, [1], F32), (FAKE, [1], F32), None, 0.0,
                                                 False, None, None, 0, 0, (FAKE, [1023], F32)),
         r"nvte_quantize_current_scaling: amax_workspace has 1023 elements; it needs "
         r"nvte_amax_workspace_elements\(\) = 1024"),
        (lambda: native.quantize_current_scaling((FAKE, [2, 4], BF16), (FAKE, [2, 4], E4M3), None,
                                                 (FAKE, [1], F32), (FAKE, [1], F32), None, 0.0,
                                                 False, None, None, 0, 0, (FAKE, [1024], BF16)),
         r"nvte_quantize_current_scaling: amax_workspace has dtype BFloat16"),
        (lambda: native.dequantize((FAKE, [4], BF16), (FAKE, [1], F32), (FAKE, [4], F32), 0, 0),
         r"nvte_dequantize: input has dtype BFloat16; expected one of Float8E4M3, Float8E5M2"),
        (lambda: native.compute_scale_from_amax((FAKE, [1], F32), (FAKE, [1], F32), BF16, 0.0,
                                                False, 0, 0),
         r"fp8_dtype BFloat16 \(6\) is not an FP8 format"),
        (lambda: native.compute_scale_from_amax((FAKE, [1], F32), (FAKE, [1], F32), E4M3, -1.0,
                                                False, 0, 0),
         r"epsilon=-1 must be a finite number >= 0"),
        (lambda: native.delayed_scaling_update(None, [(FAKE, [2, 3], F32)], [(FAKE, [2], F32)],
                                               True, E4M3, 0.0, 0, 0),
         r"scales\[0\] must have shape \[3\] to match amax_histories\[0\]"),
        (lambda: native.delayed_scaling_update((FAKE, [4], F32), [(FAKE, [2, 3], F32)],
                                               [(FAKE, [3], F32)], True, E4M3, 0.0, 0, 0),
         r"amax_reduction_buffer has 4 elements but the histories have 3 slots"),
        (lambda: native.delayed_scaling_update(None, [(FAKE, [2, 3], F32)], [(FAKE, [3], F32)],
                                               True, E4M3, float("nan"), 0, 0),
         r"margin=nan must be finite"),
        (lambda: native.compute_amax((FAKE, [4], BF16), (FAKE, [1], F32), -1, 0),
         r"device=-1 is not a CUDA device index"),
        (lambda: native.compute_amax((FAKE, list(range(1, 10)), BF16), (FAKE, [1], F32), 0, 0),
         r"at most 8"),
        (lambda: native.compute_amax((FAKE, [4], 99), (FAKE, [1], F32), 0, 0),
         r"unknown dtype code 99"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_with_a_message_naming_them(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path")
def test_without_a_cuda_driver_calls_fail_cleanly():
    with pytest.raises(RuntimeError, match=r"nvte_compute_amax: cudaGetDeviceCount failed: cuda"):
        native.compute_amax((FAKE, [4], BF16), (FAKE, [1], F32), 0, 0)
    with pytest.raises(RuntimeError, match=r"nvte_device_count: cudaGetDeviceCount failed"):
        native.device_count()


@pytest.mark.parametrize("rows, cols", [(0, 8), (1, 8), (64, 3), (65, 3), (4096, 4096)])
def test_dbias_workspace_size_matches_the_python_side(rows, cols):
    from transformer_engine.pytorch.cpp_extensions.cast import DBIAS_TILE_ROWS

    expected = -(-rows // DBIAS_TILE_ROWS) * cols
    assert native.quantize_dbias_workspace_elements(rows, cols) == expected


def test_amax_workspace_size_matches_the_python_side():
    from transformer_engine.pytorch.cpp_extensions.cast import AMAX_WORKSPACE_ELEMENTS

    assert native.amax_workspace_elements() == AMAX_WORKSPACE_ELEMENTS
