#!/usr/bin/env bash
# Builds norm_kernels_abi.cu against one source tree's kernels, for Hopper (sm_90):
#   benchmarks/native/build_norm_kernels_abi.sh SRC OUT
# SRC: a tree's transformer_engine/common directory (for a past commit:
#   git archive COMMIT transformer_engine/common | tar -x -C /tmp/old
# then SRC=/tmp/old/transformer_engine/common); OUT: the output prefix, giving OUT_fwd and
# OUT_bwd. The binaries link the CUDA runtime statically: carry them to a GPU machine and run
# them there (`OUT_bwd label`). NVCC_FLAGS adds flags (another -arch, say).
source "$(dirname "$0")/abi_build_setup.sh" "$@"
# The forward's FP8 output with the transposed copy runs a second kernel of its own file where
# the tree has one (trees before it: the norm kernel alone); cast/quantize.cu gives the forward
# binary's baseline (the norm's high-precision output, then nvte_quantize).
fwd_units=(normalization/norm_forward.cu cast/quantize.cu)
if [ -f "$src/normalization/norm_cast_transpose.cu" ]; then
  fwd_units+=(normalization/norm_cast_transpose.cu)
fi
compile_objects transformer_engine.cpp util/buffer.cpp util/device.cpp "${fwd_units[@]}"
common=("$objs/transformer_engine.cpp.o" "$objs/buffer.cpp.o" "$objs/device.cpp.o")
second=()
if [ -f "$objs/norm_cast_transpose.cu.o" ]; then second+=("$objs/norm_cast_transpose.cu.o"); fi
nvcc "${flags[@]}" -DNORM_ABI_FORWARD "$here/norm_kernels_abi.cu" "${common[@]}" \
  "$objs/quantize.cu.o" "${second[@]}" -o "${out}_fwd" &
fwd=$!
# The backward binary calls nvte_norm_forward for its statistics.
nvcc "${flags[@]}" "$here/norm_kernels_abi.cu" "${common[@]}" "$objs/norm_forward.cu.o" \
  "${second[@]}" -o "${out}_bwd" &
bwd=$!
wait "$fwd" && wait "$bwd"
