"""``python -m transformer_engine``: print the version, the native library's status and the
cuBLASLt its block-scaled GEMM found (0: none usable; that GEMM then runs on torch._scaled_mm)."""

import transformer_engine
from transformer_engine.common.native import native_module

print(f"transformer_engine {transformer_engine.__version__}")
print(transformer_engine.native_status())
_native = native_module()
if _native is not None and hasattr(_native, "cublaslt_version"):
    print(f"cuBLASLt for the block-scaled GEMM: {_native.cublaslt_version() or 'none usable'}")
