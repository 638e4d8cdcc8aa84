#!/usr/bin/env bash
# Runs several builds of an ABI benchmark (the binaries of build_norm_kernels_abi.sh or
# build_activation_kernels_abi.sh, from different source trees) in turn, RUNS times, and prints
# each measurement's fraction of the copy per build side by side, one line a kernel and shape:
#   benchmarks/native/alternate_abi_runs.sh RUNS "BIN1 BIN2 ..." [SHAPE ...]
# Each binary runs as `BIN LABEL SHAPE...`, LABEL being its file name. The builds alternate
# within every run, so the GPU's clock drift (it runs power-capped) reaches each build alike;
# compare builds only within one call. The binaries' own lines (checksums included) go to
# $ABI_LOG when it is set.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RUNS \"BIN1 BIN2 ...\" [SHAPE ...]" >&2
  exit 2
fi
runs=$1
bins=$2
shift 2
for ((r = 0; r < runs; r++)); do
  for bin in $bins; do
    "$bin" "$(basename "$bin")" "$@"
  done
done | tee "${ABI_LOG:-/dev/null}" | awk '
  # "[LABEL] <kernel and shape ...> <t> ms <fraction> of copy ...": the key is what precedes the
  # time, the value the fraction before the first "of copy".
  / of copy/ {
    label = $1
    gsub(/^\[|\]$/, "", label)
    key = ""
    for (i = 2; i < NF && $(i + 1) != "ms"; i++) key = key (key == "" ? "" : " ") $i
    for (j = i; j + 2 <= NF; j++) {
      if ($(j + 1) == "of" && $(j + 2) == "copy") {
        values[key, label] = values[key, label] " " $j
        break
      }
    }
    if (!(key in seen)) { seen[key] = 1; keys[++n] = key }
    if (!(label in seen_label)) { seen_label[label] = 1; labels[++m] = label }
  }
  END {
    for (k = 1; k <= n; k++) {
      line = keys[k]
      for (l = 1; l <= m; l++) line = line " | " labels[l] ":" values[keys[k], labels[l]]
      print line
    }
  }'
