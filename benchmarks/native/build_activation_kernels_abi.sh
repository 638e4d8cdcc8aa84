#!/usr/bin/env bash
# Builds activation_kernels_abi.cu against one source tree's kernels, for Hopper (sm_90):
#   benchmarks/native/build_activation_kernels_abi.sh SRC OUT
# SRC: a tree's transformer_engine/common directory (for a past commit:
#   git archive COMMIT transformer_engine/common | tar -x -C /tmp/old
# then SRC=/tmp/old/transformer_engine/common); OUT: the binary. It links the CUDA runtime
# statically: carry it to a GPU machine and run it there (`OUT label [ROWSxCOLS ...]`).
# NVCC_FLAGS adds flags (another -arch, say).
source "$(dirname "$0")/abi_build_setup.sh" "$@"
compile_objects transformer_engine.cpp util/buffer.cpp util/device.cpp \
  activation/activation_checks.cu activation/activation_forward.cu \
  activation/activation_backward.cu activation/activation_backward_amax.cu \
  cast/quantize_dbias.cu cast/quantize.cu
nvcc "${flags[@]}" "$here/activation_kernels_abi.cu" "$objs"/*.o -o "$out"
