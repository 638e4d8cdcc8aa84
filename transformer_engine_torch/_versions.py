"""Library versions as upstream's extension reports them: raw integers
(``major * 10000 + minor * 100 + patch``, e.g. 120103 for cuBLASLt 12.1.3).

Upstream links cuBLASLt and cuDNN and asks them. This package's native library does not link
cuBLASLt (its GEMMs run on PyTorch's, and its block-scaled GEMM opens PyTorch's cuBLASLt with
``dlopen``), so the version is that of the cuBLASLt PyTorch loads:
read with ``cublasLtGetVersion`` from the library of PyTorch's CUDA major version. A PyTorch
built without CUDA has none, and asking raises ``RuntimeError`` instead of inventing a number.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch

__all__ = ["get_cublasLt_version", "get_cudnn_version"]


def _cublaslt_candidates(cuda_major: str) -> list[str]:
    """Where libcublasLt may be: already loaded by PyTorch (found by soname), the pip wheel's
    ``nvidia/cublas/lib``, then the loader's search path."""
    names = [f"libcublasLt.so.{cuda_major}"]
    try:
        import nvidia.cublas  # the CUDA wheels of PyTorch depend on nvidia-cublas-cu*

        for base in nvidia.cublas.__path__:
            names.append(os.path.join(base, "lib", f"libcublasLt.so.{cuda_major}"))
    except ImportError:
        pass
    found = ctypes.util.find_library("cublasLt")
    if found:
        names.append(found)
    return names


@functools.lru_cache(maxsize=1)
def get_cublasLt_version() -> int:  # noqa: N802 (upstream's name)
    """cuBLASLt's version as an ``int`` (120103 = 12.1.3); ``RuntimeError`` without CUDA."""
    cuda = torch.version.cuda
    if cuda is None:
        raise RuntimeError(
            "get_cublasLt_version: this PyTorch build has no CUDA (torch.version.cuda is None), "
            "so there is no cuBLASLt whose version could be reported; install a CUDA build of "
            "PyTorch"
        )
    tried = []
    for name in _cublaslt_candidates(cuda.split(".")[0]):
        try:
            lib = ctypes.CDLL(name)
        except OSError as err:
            tried.append(f"{name} ({err})")
            continue
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        lib.cublasLtGetVersion.argtypes = []
        return int(lib.cublasLtGetVersion())
    raise RuntimeError(
        "get_cublasLt_version: no cuBLASLt library could be loaded for CUDA "
        f"{cuda}; tried {', '.join(tried)}"
    )


def get_cudnn_version() -> int:
    """cuDNN's version as PyTorch reports it (``torch.backends.cudnn.version()``, the same raw
    integer upstream returns, e.g. 90100 for 9.1.0); ``RuntimeError`` when PyTorch has none."""
    version = torch.backends.cudnn.version()
    if version is None:
        raise RuntimeError(
            "get_cudnn_version: this PyTorch build has no cuDNN "
            "(torch.backends.cudnn.version() is None)"
        )
    return int(version)
