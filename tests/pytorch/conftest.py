"""Fixtures every test under tests/pytorch gets, and the shared helpers' import path."""

import sys
from pathlib import Path

import pytest
import torch

# The suites live in subfolders (kernels/, tensor/, quantization/, module/, ops/, distributed/,
# scripts/); the helpers they share (utils.py, tolerances.py) live here.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


@pytest.fixture(autouse=True)
def fresh_state():
    """Each test starts and ends with empty quantization state (autocast, amax registry), and
    leaves the device-guard stack balanced. Each test also starts from the same random state, so
    the values a test draws from torch's global generator do not depend on which tests ran before
    it in the process (an FP8 tolerance that holds for one draw may not hold for every draw)."""
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    yield
    assert guard_depth() == 0, "a forward or backward left the device guard open"
    FP8GlobalStateManager.reset()
