"""The native norm wrappers' argument checks (cpp_extensions.norm_kernels), which run before
any native call: on CPU tensors they raise naming the value, and valid CPU calls return None
(the kernels are CUDA-only; the caller runs its PyTorch path)."""

import pytest
import torch

from transformer_engine.pytorch.cpp_extensions.norm_kernels import (
    norm_amax,
    norm_backward,
    norm_forward,
    norm_forward_fp8,
    norm_forward_fp8_from_stats,
)

H = 16


def _args(**over):
    args = {
        "x": torch.randn(4, H),
        "weight": torch.ones(H),
        "bias": torch.zeros(H),
        "eps": 1e-5,
        "zero_centered_gamma": False,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, rms, error, message",
    [
        ({"x": torch.randn(4, H, dtype=torch.float64)}, False, TypeError, "x has dtype"),
        ({"x": torch.randn(4, 0)}, False, ValueError, "non-empty last dimension"),
        ({"weight": torch.ones(H + 1)}, False, ValueError, r"weight has shape \(17,\)"),
        ({"weight": torch.ones(H, dtype=torch.float16)}, False, TypeError, "weight has dtype"),
        ({"weight": torch.ones(2 * H)[::2]}, False, ValueError, "weight is not contiguous"),
        ({"bias": torch.zeros(H, dtype=torch.bfloat16)}, False, TypeError, "bias has dtype"),
        ({}, True, ValueError, "RMSNorm has no bias"),
        ({"eps": -1.0}, False, ValueError, "eps must be a finite number"),
        ({"eps": "a"}, False, TypeError, "eps must be a number"),
        ({"zero_centered_gamma": 1}, False, TypeError, "zero_centered_gamma must be a bool"),
        ({"weight": torch.ones(H, device="meta")}, False, ValueError, "weight"),
    ],
)
def test_forward_refuses_bad_arguments(over, rms, error, message):
    a = _args(**over)
    with pytest.raises(error, match=message):
        norm_forward(a["x"], a["weight"], a["bias"], a["eps"], a["zero_centered_gamma"], rms=rms)


def test_fp8_arguments_are_checked():
    a = _args()
    with pytest.raises(TypeError, match="fp8_dtype"):
        norm_forward_fp8(*a.values(), rms=False, scale=torch.ones(1), fp8_dtype=torch.int8)
    with pytest.raises(TypeError, match="scale must be float32"):
        norm_forward_fp8(
            *a.values(), rms=False, scale=torch.ones(1, dtype=torch.float64),
            fp8_dtype=torch.float8_e4m3fn,
        )  # fmt: skip
    with pytest.raises(TypeError, match="amax must be"):
        norm_amax(*a.values(), rms=False, amax=None)


def test_statistics_arguments_are_checked():
    a = _args()
    x, w, b = a["x"], a["weight"], a["bias"]
    stat = torch.ones(4)
    amax = torch.zeros(1)
    with pytest.raises(ValueError, match="pass rsigma and mean"):
        norm_amax(*a.values(), rms=False, amax=amax, rsigma=stat)
    with pytest.raises(ValueError, match="RMSNorm has no mean"):
        norm_amax(x, w, None, 1e-5, False, rms=True, amax=amax, mean=stat, rsigma=stat)
    with pytest.raises(ValueError, match="rsigma has 3 elements; expected 4"):
        norm_amax(x, w, None, 1e-5, False, rms=True, amax=amax, rsigma=torch.ones(3))
    scale = torch.ones(1)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="pass rsigma and mean"):
        norm_forward_fp8_from_stats(x, w, b, False, rms=False, mean=None, rsigma=stat,
                                    scale=scale, fp8_dtype=fp8)  # fmt: skip
    with pytest.raises(ValueError, match="pass rsigma"):
        norm_forward_fp8_from_stats(x, w, None, False, rms=True, mean=None, rsigma=None,
                                    scale=scale, fp8_dtype=fp8)  # fmt: skip
    with pytest.raises(TypeError, match="mean has dtype"):
        norm_forward_fp8_from_stats(x, w, b, False, rms=False, mean=stat.double(), rsigma=stat,
                                    scale=scale, fp8_dtype=fp8)  # fmt: skip
    with pytest.raises(ValueError, match="rsigma is not contiguous"):
        norm_forward_fp8_from_stats(x, w, None, False, rms=True, mean=None,
                                    rsigma=torch.ones(8)[::2], scale=scale, fp8_dtype=fp8)  # fmt: skip
    with pytest.raises(TypeError, match="fp8_dtype"):
        norm_forward_fp8_from_stats(x, w, b, False, rms=False, mean=stat, rsigma=stat,
                                    scale=scale, fp8_dtype=torch.int8)  # fmt: skip
    # Valid CPU calls: None (the caller runs its PyTorch path).
    assert norm_amax(*a.values(), rms=False, amax=amax, mean=stat, rsigma=stat) is None
    assert norm_forward_fp8_from_stats(x, w, b, False, rms=False, mean=stat, rsigma=stat,
                                       scale=scale, fp8_dtype=fp8) is None  # fmt: skip


def test_backward_arguments_are_checked():
    x = torch.randn(4, H)
    stat = torch.ones(4)
    w = torch.ones(H)
    with pytest.raises(ValueError, match="dz has shape"):
        norm_backward(torch.randn(4, H + 1), x, stat, stat, w, False, rms=False, with_dbeta=True)
    with pytest.raises(ValueError, match="mean has 3 elements; expected 4"):
        norm_backward(x, x, torch.ones(3), stat, w, False, rms=False, with_dbeta=True)
    with pytest.raises(TypeError, match="rsigma has dtype"):
        norm_backward(x, x, stat, stat.double(), w, False, rms=False, with_dbeta=True)
    with pytest.raises(ValueError, match="RMSNorm has no mean"):
        norm_backward(x, x, stat, stat, w, False, rms=True, with_dbeta=False)
    with pytest.raises(ValueError, match="with_dbeta=False"):
        norm_backward(x, x, None, stat, w, False, rms=True, with_dbeta=True)


def test_valid_cpu_calls_return_none():
    a = _args()
    assert norm_forward(*a.values(), rms=False) is None
    assert norm_forward(a["x"], a["weight"], None, 1e-5, True, rms=True) is None
    scale = torch.ones(1)
    assert (
        norm_forward_fp8(*a.values(), rms=False, scale=scale, fp8_dtype=torch.float8_e5m2) is None
    )
    assert norm_amax(*a.values(), rms=False, amax=torch.zeros(1)) is None
    x = a["x"]
    assert norm_backward(x, x, torch.ones(4), torch.ones(4), a["weight"], False, rms=False,
                         with_dbeta=True) is None  # fmt: skip
