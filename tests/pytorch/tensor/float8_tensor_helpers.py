"""Helpers shared by the Float8Tensor test files (test_float8_quantizers.py,
test_float8_usages_and_storage.py, test_float8_tensor_ops.py,
test_float8_tensor_params_and_autograd.py): sample inputs, delayed-scaling state shaped like the
recipe state's (``scale`` a 0-d view into a scale vector, ``amax`` a one-element view into row 0
of an amax history), the oracle's expected bytes, and a delayed-scaling FP8 parameter."""

from __future__ import annotations

import fp8_oracle as oracle
import torch

from transformer_engine.pytorch.tensor import Float8Quantizer

E4M3 = torch.float8_e4m3fn


E5M2 = torch.float8_e5m2
HP = (torch.float32, torch.float16, torch.bfloat16)


def sample(shape=(4, 8), dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


class DelayedState:
    """Scale vector and amax history shaped like the recipe state's (N slots, L rows)."""

    def __init__(self, slots=3, history=4, scale=2.0):
        self.scale = torch.full((slots,), scale)
        self.amax_history = torch.zeros(history, slots)

    def quantizer(self, i=1, fp8=E4M3, **kw) -> Float8Quantizer:
        return Float8Quantizer(
            self.scale[i], self.amax_history[0][i].reshape((1,)), fp8, **kw
        )  # fmt: skip


def expected_bytes(x, scale, fp8=E4M3):
    return oracle.cast_bytes(x, torch.as_tensor(scale, dtype=torch.float32), fp8)


def fp8_param(shape=(4, 8), seed=0, scale=2.0):
    state = DelayedState(scale=scale)
    with torch.no_grad():
        t = state.quantizer()(sample(shape, seed=seed))
    return t, state
