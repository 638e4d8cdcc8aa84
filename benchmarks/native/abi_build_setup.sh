# Sourced by the build_*_kernels_abi.sh scripts with their SRC and OUT arguments: sets src (the
# tree's transformer_engine/common, absolute), out, here (this directory), flags (nvcc's, for
# Hopper; NVCC_FLAGS adds more) and objs (a scratch directory removed on exit), and defines
# compile_objects FILE... (each FILE of src compiled to objs in parallel).
set -euo pipefail
src=$(cd "$1" && pwd)
out=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
flags=(-arch=sm_90 -O3 -std=c++17 --expt-relaxed-constexpr -prec-div=true -ftz=false
       -I "$src/include" -I "$src" -DNVTE_VERSION_STRING=\"kernels_abi\" ${NVCC_FLAGS:-})
objs=$(mktemp -d)
trap 'rm -rf "$objs"' EXIT

compile_objects() {
  local f
  for f in "$@"; do
    nvcc "${flags[@]}" -c "$src/$f" -o "$objs/$(basename "$f").o" &
  done
  wait
}
