"""Build the native library (CMake + nvcc + pybind11) from setup.py.

Environment variables, all read here and only at build time:

* ``NVTE_BUILD_NATIVE``: ``0`` builds a pure-Python package (CPU reference path only);
  anything else, or unset, builds the native library and fails if nvcc is missing.
* ``NVTE_CUDA_ARCHS``: semicolon-separated compute capabilities, default ``89;90;100;120``.
  Each gets real machine code; the newest also gets PTX so later GPUs can JIT it.
* ``MAX_JOBS``: build parallelism (default: CMake's choice).
* ``CUDA_HOME`` / ``CUDA_PATH``: where nvcc is looked for first (then PATH, then
  /usr/local/cuda).
* ``NVTE_CMAKE_BUILD_DIR``: a persistent CMake build directory (incremental rebuilds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension
from setuptools.command.build_ext import build_ext

DEFAULT_CUDA_ARCHS = "89;90;100;120"
FALLBACK_NVCC = Path("/usr/local/cuda/bin/nvcc")
REPO_ROOT = Path(__file__).resolve().parent.parent


def native_build_requested() -> bool:
    return os.environ.get("NVTE_BUILD_NATIVE", "1").strip() != "0"


def find_nvcc() -> str:
    """Path of nvcc, or a RuntimeError that says how to get one."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(FALLBACK_NVCC)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(
        "transformer_engine: cannot build the native library because nvcc (the CUDA compiler) "
        "was not found in $CUDA_HOME/bin, on PATH, or in /usr/local/cuda/bin. Install the CUDA "
        "toolkit (12.8 or newer), or `pip install nvidia-cuda-nvcc` and point CUDA_HOME at it; "
        "or build a CPU-only, pure-Python package with NVTE_BUILD_NATIVE=0."
    )


def cmake_cuda_architectures(spec: str) -> str:
    """``"89;90"`` -> ``"89-real;90"``: real code for each, PTX as well for the newest."""
    archs = [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]
    if not archs:
        raise RuntimeError(f"NVTE_CUDA_ARCHS={spec!r} names no architecture; e.g. '90' or '89;90'")
    if archs in (["native"], ["all"], ["all-major"]):
        return archs[0]
    for arch in archs:
        if not arch.rstrip("af").isdigit():
            raise RuntimeError(
                f"NVTE_CUDA_ARCHS entry {arch!r} is not a compute capability such as 90 or 90a"
            )
    newest = max(archs, key=lambda a: int(a.rstrip("af")))
    return ";".join(a if a == newest else f"{a}-real" for a in archs)


class CMakeExtension(Extension):
    """An extension built by CMake rather than by setuptools' compiler."""

    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures, builds and installs the CMake project into the package directory."""

    def run(self):
        for ext in self.extensions:
            self.build_cmake(ext)

    def build_cmake(self, ext: CMakeExtension) -> None:
        import pybind11

        nvcc = find_nvcc()
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError(
                "transformer_engine: cmake >= 3.21 is required (`pip install cmake`)"
            )
        # The extension's file lands in <prefix>/transformer_engine/, which is where CMake
        # installs both the library and the binding.
        prefix = Path(self.get_ext_fullpath(ext.name)).resolve().parent.parent
        build_dir = Path(os.environ.get("NVTE_CMAKE_BUILD_DIR") or Path(self.build_temp) / "cmake")
        build_dir.mkdir(parents=True, exist_ok=True)
        archs = cmake_cuda_architectures(os.environ.get("NVTE_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
        from transformer_engine import __version__  # noqa: PLC0415  (source tree, no torch)

        configure = [
            cmake,
            "-S", str(REPO_ROOT),
            "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DNVTE_VERSION={__version__}",
        ]  # fmt: skip
        if shutil.which("ninja"):
            configure.append("-GNinja")
        build = [cmake, "--build", str(build_dir)]
        jobs = os.environ.get("MAX_JOBS")
        if jobs:
            build += ["--parallel", jobs]
        print(f"transformer_engine: building the native library for CUDA archs {archs}", flush=True)
        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)
        subprocess.run([cmake, "--install", str(build_dir)], check=True)
