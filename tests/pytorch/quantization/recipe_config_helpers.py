"""Helpers shared by the recipe configuration test files (test_recipe_config_fields.py,
test_recipe_config_equality_and_repr.py, test_recipe_config_validation_and_env.py): the recipe
environment variables, the autouse fixture that unsets them for every test (a test file gets it
by importing it), and a fresh interpreter that runs a snippet with only the given recipe
environment variables; and the compute algorithms given to DelayedScaling."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from utils import REPO_ROOT

ENV_POWER_2 = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"
ENV_BACKWARD = "NVTE_BACKWARD_OVERRIDE"


@pytest.fixture(autouse=True)
def _clean_recipe_env(monkeypatch):
    """Every test starts with the recipe environment variables unset."""
    monkeypatch.delenv(ENV_POWER_2, raising=False)
    monkeypatch.delenv(ENV_BACKWARD, raising=False)


def _run_python(code: str, *flags: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (with ``flags``) and the recipe env vars ``env`` only."""
    child_env = {k: v for k, v in os.environ.items() if k not in (ENV_POWER_2, ENV_BACKWARD)}
    child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else [])
    )
    result = subprocess.run(
        [sys.executable, *flags, "-c", code],
        env=child_env,
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    return result.stdout.strip()


def _algo(history):
    return history


def _sf(amax, scale, fp8_max, recipe):
    return scale
