"""te.Fp8Padding / te.Fp8Unpadding: per-group zero rows up to the FP8 alignment around a
GroupedLinear (upstream's padding; the GroupedLinear here takes any group size in FP8, and the
padded run gives the unpadded run's result)."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

SPLITS = [5, 0, 19, 16]


def test_padding_appends_zero_rows_per_group_and_unpadding_removes_them():
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    padded, sizes = te.Fp8Padding(4)(x, SPLITS)
    assert sizes == [16, 0, 32, 16] and padded.shape == (64, 3)
    assert torch.equal(padded[:5], x[:5]) and torch.equal(padded[5:16], torch.zeros(11, 3))
    assert torch.equal(padded[16:35], x[5:24]) and torch.equal(padded[35:48], torch.zeros(13, 3))
    assert torch.equal(padded[48:], x[24:])
    assert torch.equal(te.Fp8Unpadding(4)(padded, SPLITS), x)


def test_aligned_groups_are_not_copied_and_align_size_is_honoured():
    x = torch.randn(32, 8)
    out, sizes = te.Fp8Padding(2)(x, [16, 16])
    assert out is x and sizes == [16, 16]
    out, sizes = te.Fp8Padding(2, align_size=4)(torch.randn(2, 5, 8), torch.tensor([3, 7]))
    assert sizes == [4, 8] and out.shape == (12, 8)  # leading dimensions flattened


def test_gradients_skip_the_padding_rows():
    x = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    pad, unpad = te.Fp8Padding(4), te.Fp8Unpadding(4)
    torch.autograd.gradcheck(lambda t: pad(t, SPLITS)[0], (x,))
    padded = pad(x, SPLITS)[0].detach().requires_grad_(True)
    torch.autograd.gradcheck(lambda t: unpad(t, SPLITS), (padded,))


@pytest.mark.parametrize("recipe", [DelayedScaling, Float8CurrentScaling])
def test_grouped_linear_gives_the_same_result_with_and_without_padding(recipe):
    # Padding is not needed (any group size runs in FP8), and it changes nothing: zero rows
    # leave every amax, so every FP8 byte, unchanged and add only zero products.
    pad, unpad = te.Fp8Padding(4), te.Fp8Unpadding(4)
    x0 = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(40, 48, generator=torch.Generator().manual_seed(2))
    runs = []
    for padded_run in (False, True):
        torch.manual_seed(0)  # the same weights, and a fresh recipe state, for both runs
        layer = te.GroupedLinear(4, 32, 48, device="cpu")
        x = x0.clone().requires_grad_(True)
        with te.autocast(recipe=recipe()):
            if padded_run:
                padded, sizes = pad(x, SPLITS)
                y = unpad(layer(padded, sizes), SPLITS)
            else:
                y = layer(x, SPLITS)
        y.backward(dy)
        assert y.shape == (40, 48) and x.grad.shape == (40, 32)
        runs.append([y, x.grad] + [p.grad.clone() for p in layer.parameters()])
    for plain, padded in zip(*runs):
        assert_close_by_table(plain, padded, ("fp8_dequantized", torch.float32))
    # against per-group linear layers in float32 (FP8 tolerance)
    x = x0.clone().requires_grad_(True)
    reference, start = [], 0
    for i, rows in enumerate(SPLITS):
        w, b = layer.get_parameter(f"weight{i}"), layer.get_parameter(f"bias{i}")
        reference.append(F.linear(x[start : start + rows], w.detach(), b.detach()))
        start += rows
    reference = torch.cat(reference)
    assert_close_by_table(runs[0][0], reference, ("e4m3", torch.float32))
    reference.backward(dy)
    assert_close_by_table(runs[0][1], x.grad, ("hybrid", torch.float32))
    start = 0
    for i, rows in enumerate(SPLITS):
        dw = dy[start : start + rows].t() @ x0[start : start + rows]
        assert_close_by_table(layer.get_parameter(f"weight{i}").grad, dw, ("hybrid", torch.float32))
        start += rows


def test_bad_split_sizes_are_refused():
    x = torch.randn(40, 3)
    with pytest.raises(ValueError, match="got 3 split sizes for num_gemms=4"):
        te.Fp8Padding(4)(x, [5, 0, 35])
    with pytest.raises(ValueError, match="sum to 39, not 40 rows"):
        te.Fp8Padding(4)(x, [5, 0, 18, 16])
    with pytest.raises(ValueError, match="non-negative ints"):
        te.Fp8Padding(4)(x, [5, -1, 20, 16])
    with pytest.raises(ValueError, match="pass the sizes given to Fp8Padding"):
        te.Fp8Unpadding(4)(torch.randn(63, 3), SPLITS)
    with pytest.raises(ValueError, match="num_gemms=0"):
        te.Fp8Padding(0)
    with pytest.raises(ValueError, match="align_size=0"):
        te.Fp8Unpadding(2, align_size=0)
