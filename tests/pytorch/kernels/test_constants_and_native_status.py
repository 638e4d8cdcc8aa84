"""CPU tests of the dtype constants of transformer_engine.pytorch.constants (DType values and
casts, the TE/torch dtype tables, to_torch_fp8_dtype, fp8_max) and of the native library status
(transformer_engine.native_status() and ``python -m transformer_engine``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cast_wrappers_helpers import (
    E4M3,
    E5M2,
    _no_warnings_on_cpu,  # noqa: F401 (autouse fixture)
)
from utils import REPO_ROOT

import transformer_engine
from transformer_engine.pytorch.constants import (
    DType,
    TE_DType,
    TE_DType_To_Torch,
    fp8_max,
    to_torch_fp8_dtype,
)

# ---------------------------------------------------------------- constants


def test_dtype_values():
    expected = dict(kByte=0, kInt32=2, kFloat32=4, kFloat16=5, kBFloat16=6, kFloat8E4M3=7,
                    kFloat8E5M2=8, kFloat4E2M1=10)  # fmt: skip
    for name, value in expected.items():
        assert int(getattr(DType, name)) == value


def test_dtype_cast():
    assert DType.cast(DType.kFloat8E5M2) is DType.kFloat8E5M2
    assert DType.cast(7) is DType.kFloat8E4M3
    assert DType.cast(torch.float8_e5m2) is DType.kFloat8E5M2
    assert DType.cast(torch.bfloat16) is DType.kBFloat16

    class Wrapped:
        value = 4

    assert DType.cast(Wrapped()) is DType.kFloat32
    with pytest.raises(TypeError, match="torch.float64 has no transformer_engine DType"):
        DType.cast(torch.float64)
    with pytest.raises(ValueError):
        DType.cast(3)


def test_te_dtype_tables():
    assert TE_DType[torch.float8_e4m3fn] == DType.kFloat8E4M3
    assert TE_DType[torch.uint8] == DType.kByte
    assert all(TE_DType_To_Torch[v] == k for k, v in TE_DType.items())


@pytest.mark.parametrize(
    "arg,expected",
    [
        (E4M3, E4M3),
        (E5M2, E5M2),
        (DType.kFloat8E4M3, E4M3),
        (DType.kFloat8E5M2, E5M2),
        (7, E4M3),
        (8, E5M2),
    ],
)
def test_to_torch_fp8_dtype(arg, expected):
    assert to_torch_fp8_dtype(arg) is expected


@pytest.mark.parametrize(
    "arg", [torch.float32, torch.uint8, DType.kFloat32, DType.kFloat4E2M1, 99, "e4m3", None]
)
def test_to_torch_fp8_dtype_rejects(arg):
    with pytest.raises(TypeError, match="is not an FP8 format"):
        to_torch_fp8_dtype(arg)


def test_fp8_max():
    assert fp8_max(E4M3) == 448.0 and fp8_max(DType.kFloat8E4M3) == 448.0
    assert fp8_max(E5M2) == 57344.0 and fp8_max(8) == 57344.0
    with pytest.raises(TypeError):
        fp8_max(torch.float16)


# ---------------------------------------------------------------- native status


def test_native_status():
    st = transformer_engine.native_status()
    assert isinstance(st.available, bool)
    assert st is transformer_engine.native_status()  # loaded once
    if st.available:
        assert st.path and "native library loaded" in str(st)
    else:
        assert isinstance(st.reason, str) and st.reason.strip()
        assert str(st).startswith("native library not available:") and st.reason in str(st)


def test_python_dash_m_prints_status():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_engine"], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "native library" in proc.stdout
    assert transformer_engine.__version__ in proc.stdout
