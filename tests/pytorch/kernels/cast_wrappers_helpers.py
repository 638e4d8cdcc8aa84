"""Helpers shared by the CPU tests of the cast kernel wrappers (test_cast_wrappers_quantize.py,
test_cast_wrappers_delayed_scaling.py, test_cast_wrappers_refusals.py,
test_constants_and_native_status.py): the FP8 and high-precision dtypes, a sample input with
NaN, +-Inf and -0, the autouse fixture that turns RuntimeWarnings into errors (CPU tensors run
the reference by design: no fallback warning; a test file gets it by importing it), and the
prefilled output buffers a refused or no-op call must leave unchanged."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from utils import uint8_view

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
HP = (torch.float32, torch.float16, torch.bfloat16)
NAN, INF = math.nan, math.inf


def sample(shape=(2, 3, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 100
    flat = x.view(-1)
    flat[:4] = torch.tensor([NAN, INF, -INF, -0.0])
    return x.to(dtype)


@pytest.fixture(autouse=True)
def _no_warnings_on_cpu():
    # CPU tensors run the reference by design: no fallback warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _filled_buffers(x):
    return dict(
        out=torch.full(x.shape, 0x11, dtype=torch.uint8).view(E4M3),
        out_transpose=torch.full((x.shape[-1], *x.shape[:-1]), 0x22, dtype=torch.uint8).view(E4M3),
        amax=torch.tensor([0.25]),
        scale_inv=torch.tensor([-2.0]),
    )


def _snapshot(bufs):
    return {k: v.clone() for k, v in bufs.items()}


def _unchanged(bufs, snap):
    return all(torch.equal(uint8_view(bufs[k]), uint8_view(snap[k])) for k in bufs)
