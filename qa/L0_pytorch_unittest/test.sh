#!/usr/bin/env bash
# Unit tests of the installed package: the CPU suites always, the GPU suites when a CUDA GPU is
# visible (they skip, with a reason, elsewhere). Every file runs even if an earlier one fails;
# the script fails if any did. Per-file JUnit XML goes to $XML_LOG_DIR when it is set.
set -uo pipefail
shopt -s nullglob

TE_PATH=${TE_PATH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-python3}
cd "$TE_PATH"

# -P: do not put the working directory on sys.path, so the *installed* package is tested.
"$PYTHON" -P -c "import transformer_engine; print(transformer_engine.native_status())"

# tests/pytorch/test_*.py: the checks of the whole package (test_layering.py); the suites live in
# subfolders that mirror the source (kernels/, tensor/, quantization/, module/, ops/, ...).
test_files=(tests/build_tools/test_*.py tests/pytorch/test_*.py tests/pytorch/*/test_*.py)
if [ ${#test_files[@]} -eq 0 ]; then
  echo "no test files found under $TE_PATH/tests"
  exit 1
fi
failures=()
for test_file in "${test_files[@]}"; do
  # The folder is part of the JUnit name: the same file name may exist in two folders.
  name=$(dirname "${test_file#tests/}" | tr '/' '_')_$(basename "$test_file" .py)
  xml_args=()
  if [ -n "${XML_LOG_DIR:-}" ]; then
    mkdir -p "$XML_LOG_DIR"
    xml_args=(--junitxml="$XML_LOG_DIR/pytest_${name}.xml")
  fi
  echo "=== $test_file"
  if ! "$PYTHON" -P -m pytest -q -rs "${xml_args[@]}" "$test_file"; then
    failures+=("$test_file")
  fi
done

if [ ${#failures[@]} -gt 0 ]; then
  echo "FAILED: ${failures[*]}"
  exit 1
fi
echo "all test files passed"
