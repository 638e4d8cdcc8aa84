"""Fixtures every test under tests/pytorch gets."""

import pytest

from transformer_engine.pytorch.device import guard_depth
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


@pytest.fixture(autouse=True)
def fresh_state():
    """Each test starts and ends with empty quantization state (autocast, amax registry), and
    leaves the device-guard stack balanced."""
    FP8GlobalStateManager.reset()
    yield
    assert guard_depth() == 0, "a forward or backward left the device guard open"
    FP8GlobalStateManager.reset()
