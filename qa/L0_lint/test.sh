#!/usr/bin/env bash
# Lint and format check: runs every hook in .pre-commit-config.yaml over the tracked files.
# Hooks that fix files (ruff format, clang-format, whitespace) leave their fixes in the working
# tree and fail the run; --show-diff-on-failure prints what they changed.
#
# Needs PyPI the first time (pre-commit installs the pinned hook tools into ~/.cache/pre-commit).
# Set PYTHON to choose the interpreter used to install pre-commit.
set -euo pipefail

PRE_COMMIT_VERSION="4.7.0" # keep equal to minimum_pre_commit_version in .pre-commit-config.yaml
PYTHON="${PYTHON:-python3}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${REPO_ROOT}"

if ! "${PYTHON}" -m pre_commit --version >/dev/null 2>&1; then
  echo "pre-commit not found for ${PYTHON}; installing pre-commit==${PRE_COMMIT_VERSION}"
  "${PYTHON}" -m pip install --quiet "pre-commit==${PRE_COMMIT_VERSION}"
fi

"${PYTHON}" -m pre_commit run --all-files --show-diff-on-failure
