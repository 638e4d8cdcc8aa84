"""The one tolerance table for GEMM and module comparisons.

Key: ``(operand format, out dtype)``; value: ``(rtol, atol)``.

Operand formats describe how far the operands the computation saw are from the operands the
float64 reference saw, and, for FP8, how the GEMM accumulated:

* ``"same_values"``: a high-precision GEMM against a reference run on exactly the values it saw
  (BF16/FP16/FP32 tensors upcast). Only accumulation order and the output rounding differ.
* ``"fp8_dequantized"``: an FP8 GEMM with split (full-precision) accumulation against a
  reference run on its dequantized operands. On CPU torch._scaled_mm accumulates exactly in
  float32 (it has no fast mode); Hopper's FP8 tensor cores add their products with less than
  float32 precision even in split mode, which the atol covers.
* ``"fp8_dequantized_fast_accum"``: the same with ``use_split_accumulator=False`` on a GPU,
  where partial sums stay in the tensor core's reduced-precision accumulator over the whole K.
* ``"bf16"``, ``"fp16"``: BF16/FP16 operands against the float32 originals they were cast from.
* ``"e4m3"``: FP8 E4M3 x E4M3 operands against the high-precision originals.
* ``"hybrid"``: E4M3 x E5M2 (HYBRID backward: E5M2 gradient with an E4M3 weight or input).

``atol`` is in units of the RMS of the expected tensor. A GEMM output element's rounding and
quantization error scales with the size of its whole dot product, which is about the output's
RMS, not with the element itself, so an absolute floor fixed in plain units would be loose for
small outputs and fail for large ones (it would depend on K and the data's scale).

How the numbers were chosen:

* ``rtol`` of the ``"same_values"`` and ``"fp8_dequantized*"`` rows is one unit in the last
  place of the output dtype (BF16 2**-7, FP16 2**-10): a round-to-nearest output is within
  half of that, and the other half covers a different accumulation order tipping a rounding the
  other way. Float32 gets 1e-5.
* ``rtol`` of the ``"bf16"``/``"fp16"`` rows is two output ulps (input rounding plus output
  rounding); of ``"e4m3"`` two E4M3 half-ulps (2 * 2**-4), of ``"hybrid"`` two E5M2 half-ulps
  (2 * 2**-3), as in upstream's FP8 tolerances (E4M3 0.125, E5M2 0.25).
* ``atol`` was measured: the smallest atol (in RMS units) that passes at a rtol of half an
  output ulp (stricter than the rows' rtol), over 10 seeds x shapes (M, K, N) in
  {(32, 64, 48), (48, 256, 32), (16, 1024, 64), (64, 4096, 64)}, weights ~ N(0, 1/K), inputs
  ~ N(0, 1), current scaling (amax maps to the FP8 maximum), on CPU (torch 2.13) and on an H200
  (torch 2.11, cuBLASLt). Each atol is about 2x the worst case seen, rounded up:

  =========================================  =====================  =========================
  row                                        CPU worst              H200 worst
  =========================================  =====================  =========================
  e4m3 (any out dtype)                       0.137                  0.138
  hybrid (any out dtype)                     0.209                  0.210
  bf16 / fp16 operands                       0.0097 / 0.0012        0.0097 / 0.0012
  same_values BF16 / FP16 / FP32             3e-7 / 4e-7 / 1.2e-6   1.1e-6 / 2e-6 / 6e-7
  fp8_dequantized BF16 / FP16 / FP32         3e-7 / 4e-7 / 1.2e-6   7.6e-4 / 1.0e-3 / 1.2e-3
  fp8_dequantized_fast_accum BF16/FP16/FP32  (as above)             9.4e-3 / 1.4e-2 / 1.5e-2
  =========================================  =====================  =========================

  The fast-accumulation error grows with K (K <= 1024: at most 4.3e-3); beyond K = 4096 use
  split accumulation for tight comparisons. FP8-vs-original error is dominated by operand
  quantization (about 4% RMS per product for E4M3, so among a few thousand output elements
  some reach 4-5 sigma); the output dtype barely matters there.
"""

from __future__ import annotations

import torch

__all__ = ["GEMM_TOLERANCES", "tolerance", "assert_close_by_table", "table_keys"]

_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

GEMM_TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("same_values", _BF16): (2**-7, 1e-4),
    ("same_values", _FP16): (2**-10, 1e-4),
    ("same_values", _FP32): (1e-5, 1e-5),
    ("fp8_dequantized", _BF16): (2**-7, 2.5e-3),
    ("fp8_dequantized", _FP16): (2**-10, 2.5e-3),
    ("fp8_dequantized", _FP32): (1e-5, 2.5e-3),
    ("fp8_dequantized_fast_accum", _BF16): (2**-7, 0.03),
    ("fp8_dequantized_fast_accum", _FP16): (2**-10, 0.03),
    ("fp8_dequantized_fast_accum", _FP32): (1e-5, 0.03),
    ("bf16", _BF16): (2**-6, 0.02),
    ("bf16", _FP32): (2**-6, 0.02),
    ("fp16", _FP16): (2**-9, 0.0025),
    ("fp16", _FP32): (2**-9, 0.0025),
    ("e4m3", _BF16): (0.125, 0.25),
    ("e4m3", _FP16): (0.125, 0.25),
    ("e4m3", _FP32): (0.125, 0.25),
    ("hybrid", _BF16): (0.25, 0.375),
    ("hybrid", _FP16): (0.25, 0.375),
    ("hybrid", _FP32): (0.25, 0.375),
}


def tolerance(key: tuple[str, torch.dtype]) -> tuple[float, float]:
    """``(rtol, atol)`` of a table row; ``atol`` in units of the expected tensor's RMS."""
    try:
        return GEMM_TOLERANCES[key]
    except KeyError:
        rows = ", ".join(f"({fmt!r}, {dtype})" for fmt, dtype in GEMM_TOLERANCES)
        raise KeyError(f"no tolerance row {key!r}; rows are: {rows}") from None


def assert_close_by_table(actual: torch.Tensor, expected: torch.Tensor, key) -> None:
    """``assert_close`` with the table row ``key``; ``atol`` scaled by the RMS of ``expected``.

    Both tensors are compared in float32 and must have the same shape and device.
    """
    rtol, atol_rms = tolerance(key)
    expected = expected.detach().float()
    rms = expected.double().pow(2).mean().sqrt().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().float(),
        expected,
        rtol=rtol,
        atol=atol_rms * rms,
        msg=lambda m: f"{m}\n(tolerance row {key!r}: rtol={rtol}, atol={atol_rms} x RMS {rms:.4g})",
    )


def table_keys(recipe_name: str, dtype: torch.dtype):
    """(forward key, backward key) of a module's output and gradients against float64 of the
    values it was given: FP8 recipes forward in E4M3 and backward in HYBRID (E5M2 gradients);
    high precision is exact math in FP32 or one BF16/FP16 rounding away."""
    if recipe_name != "high_precision":
        return ("e4m3", dtype), ("hybrid", dtype)
    key = ("same_values", torch.float32) if dtype == torch.float32 else ("bf16", dtype)
    return key, key
