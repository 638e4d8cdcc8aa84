"""Build helpers (build_tools/native_build.py): nvcc discovery and CUDA architecture lists."""

import importlib.util
from pathlib import Path

import pytest

# Load build_tools/native_build.py by path: putting the repository root on sys.path would make
# later imports of transformer_engine pick up the source tree instead of the installed package.
_PATH = Path(__file__).resolve().parents[2] / "build_tools" / "native_build.py"
_spec = importlib.util.spec_from_file_location("native_build", _PATH)
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)


def test_default_archs_give_real_code_and_ptx_for_the_newest():
    assert native_build.cmake_cuda_architectures(native_build.DEFAULT_CUDA_ARCHS) == (
        "89-real;90-real;100-real;120"
    )


@pytest.mark.parametrize(
    "spec, expected",
    [("90", "90"), ("90;89", "90;89-real"), ("89, 90a", "89-real;90a"), ("native", "native")],
)
def test_arch_lists(spec, expected):
    assert native_build.cmake_cuda_architectures(spec) == expected


@pytest.mark.parametrize("spec", ["", "sm_90", "9.0"])
def test_bad_arch_lists_are_refused_with_the_fix(spec):
    with pytest.raises(RuntimeError, match="NVTE_CUDA_ARCHS"):
        native_build.cmake_cuda_architectures(spec)


def test_missing_nvcc_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(native_build, "FALLBACK_NVCC", tmp_path / "nowhere" / "nvcc")
    with pytest.raises(RuntimeError) as err:
        native_build.find_nvcc()
    message = str(err.value)
    assert "nvcc" in message and "pip install nvidia-cuda-nvcc" in message
    assert "NVTE_BUILD_NATIVE=0" in message


def test_cuda_home_wins(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert native_build.find_nvcc() == str(nvcc)


@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("0", False), (" 0 ", False)]
)
def test_native_build_switch(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("NVTE_BUILD_NATIVE", raising=False)
    else:
        monkeypatch.setenv("NVTE_BUILD_NATIVE", value)
    assert native_build.native_build_requested() is expected
