"""Build script: pure-Python package plus the native library built by CMake.

See build_tools/native_build.py for the environment variables that control the build.
"""

import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from build_tools.native_build import (  # noqa: E402
    CMakeBuild,
    CMakeExtension,
    find_nvcc,
    native_build_requested,
)

if native_build_requested():
    find_nvcc()  # fail early, with the message that says how to get nvcc
    ext_modules = [CMakeExtension("transformer_engine._native")]
else:
    ext_modules = []

setup(
    # transformer_engine_torch: upstream's extension-module name (`import transformer_engine_torch
    # as tex`), a pure-Python client of transformer_engine.pytorch shipped in every build.
    packages=find_packages(
        include=["transformer_engine", "transformer_engine.*", "transformer_engine_torch"]
    ),
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
)
