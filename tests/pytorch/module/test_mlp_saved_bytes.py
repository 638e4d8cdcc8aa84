"""Bytes autograd keeps for backward after one forward of ``te.LayerNormMLP`` and
``te.LayerNormLinear``, against the plain BF16 PyTorch block of the same shape (issue 20).

What is counted: every tensor handed to autograd for backward during the forward, seen through
``torch.autograd.graph.saved_tensors_hooks``, counted once per underlying storage (views of one
buffer, such as the two halves of a GLU input, count once) at the storage's full size (a view
keeps its whole buffer alive). An FP8 tensor counts its byte buffers (data, transposed copy,
scale_inv), whichever of them exist. Parameters are left out: they live whether or not a
backward is pending, and both sides save the same ones. The module's input is counted on both
sides.

The plain baseline normalizes with ``F.layer_norm`` for the RMSNorm cases too: on the CPU,
``F.rms_norm`` is a composite that saves three float32 copies of its input, which would inflate
the baseline (a fused RMSNorm keeps its input and one statistic per row, no more than LayerNorm's
input and two).

Targets (issue 20): BF16 at most 1.1x the plain block's bytes, FP8 at most 0.8x.

A tensor a module keeps on its autograd ``ctx`` as an attribute instead of through
``save_for_backward`` is invisible here (and to activation checkpointing and CPU offload,
which rely on the same hooks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from utils import autocast_by_name

import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

TOKENS, HIDDEN, FFN = 512, 256, 1024
BF16_TARGET = 1.1
FP8_TARGET = 0.8
PRECISIONS = ["bf16", "delayed", "current"]


def _buffers(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors whose storage ``tensor`` holds: its FP8 byte buffers for a quantized
    tensor, the tensor itself otherwise."""
    inner = [getattr(tensor, name, None) for name in ("_data", "_transpose", "_scale_inv")]
    inner = [t for t in inner if isinstance(t, torch.Tensor)]
    return inner or [tensor]


def saved_bytes(run, parameters) -> tuple[int, object]:
    """``(bytes autograd saves in run(), run()'s result)``, parameters left out.

    The result is returned so the graph, and with it the saved tensors, stays alive while the
    storages are counted: a freed storage's address could otherwise be reused and hide a buffer.
    """
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    sizes: dict[int, int] = {}

    def pack(tensor):
        for buffer in _buffers(tensor):
            storage = buffer.untyped_storage()
            address = storage.data_ptr()
            if address != 0 and address not in excluded:
                sizes[address] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return sum(sizes.values()), out


def plain_gated_or_not(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The plain activation: tanh GELU, or SwiGLU with the gate on FC1's first half (TE's
    convention)."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def plain_mlp(module: te.LayerNormMLP, x: torch.Tensor, activation: str) -> torch.Tensor:
    """The plain BF16 MLP on the module's own parameters."""
    ln = F.layer_norm(x, (HIDDEN,), module.layer_norm_weight, _norm_bias(module), 1e-5)
    h = F.linear(ln, module.fc1_weight, module.fc1_bias)
    return F.linear(plain_gated_or_not(h, activation), module.fc2_weight, module.fc2_bias)


def plain_ln_linear(module: te.LayerNormLinear, x: torch.Tensor) -> torch.Tensor:
    ln = F.layer_norm(x, (HIDDEN,), module.layer_norm_weight, _norm_bias(module), 1e-5)
    return F.linear(ln, module.weight, module.bias)


def _norm_bias(module) -> torch.Tensor | None:
    return getattr(module, "layer_norm_bias", None)


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)


def _ratio(module, run_te, run_plain, precision) -> tuple[float, int, int]:
    parameters = list(module.parameters())
    plain, _ = saved_bytes(run_plain, parameters)
    with autocast_by_name(None if precision == "bf16" else precision):
        ours, _ = saved_bytes(run_te, parameters)
    return ours / plain, ours, plain


def mlp_ratio(normalization: str, activation: str, precision: str) -> tuple[float, int, int]:
    """``(te / plain, te bytes, plain bytes)`` for LayerNormMLP(HIDDEN, FFN) on TOKENS tokens."""
    module = te.LayerNormMLP(
        HIDDEN, FFN, normalization=normalization, activation=activation,
        device="cpu", params_dtype=torch.bfloat16,
    )  # fmt: skip
    x = _input()
    return _ratio(module, lambda: module(x), lambda: plain_mlp(module, x, activation), precision)


def ln_linear_ratio(normalization: str, precision: str) -> tuple[float, int, int]:
    """``(te / plain, te bytes, plain bytes)`` for LayerNormLinear(HIDDEN, FFN) on TOKENS
    tokens."""
    module = te.LayerNormLinear(
        HIDDEN, FFN, normalization=normalization, device="cpu", params_dtype=torch.bfloat16
    )
    x = _input()
    return _ratio(module, lambda: module(x), lambda: plain_ln_linear(module, x), precision)


def _check(what: str, precision: str, measured: tuple[float, int, int]) -> None:
    ratio, ours, plain = measured
    target = BF16_TARGET if precision == "bf16" else FP8_TARGET
    assert ratio <= target, (
        f"{what} ({precision}) saves {ours} bytes for backward, {ratio:.2f}x the plain BF16 "
        f"block's {plain}; the target is at most {target}x"
    )


def test_counter_matches_hand_count_of_plain_mlp():
    """The counter against a hand count of what PyTorch saves for the plain LayerNorm + GELU MLP:
    the input, the norm's mean and rstd (one bfloat16 value per row each, in the input dtype on
    the CPU), the norm output, FC1's output and the GELU output; the weights not at all."""
    module = te.LayerNormMLP(HIDDEN, FFN, device="cpu", params_dtype=torch.bfloat16)
    x = _input()
    counted, _ = saved_bytes(lambda: plain_mlp(module, x, "gelu"), list(module.parameters()))
    row_stats = 2 * TOKENS * 2
    expected = 2 * (TOKENS * HIDDEN + TOKENS * HIDDEN + TOKENS * FFN + TOKENS * FFN) + row_stats
    assert counted == expected


def test_counter_counts_fp8_buffers_once():
    """An FP8 tensor counts its byte buffers: 1 byte per element plus a 4-byte scale_inv."""
    quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=torch.device("cpu"))
    quantizer.set_usage(rowwise=True, columnwise=False)
    fp8 = quantizer(torch.randn(64, 32))
    size = 0
    for buffer in _buffers(fp8):
        size += buffer.untyped_storage().nbytes()
    assert size == 64 * 32 + 4


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp_saved_bytes(normalization, activation, precision):
    measured = mlp_ratio(normalization, activation, precision)
    _check(f"LayerNormMLP {normalization} {activation}", precision, measured)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_saved_bytes(normalization, precision):
    measured = ln_linear_ratio(normalization, precision)
    _check(f"LayerNormLinear {normalization}", precision, measured)
