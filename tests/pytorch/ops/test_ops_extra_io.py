"""te.ops.AddExtraInput and te.ops.MakeExtraOutput, both with and without ``in_place``: values
and gradients against the same arithmetic written in plain PyTorch (float64), the in-place
memory contract (the sum lands in the extra input's storage), and the argument errors."""

import pytest
import torch

from transformer_engine.pytorch import ops


def leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("in_place", [False, True])
def test_add_extra_input_matches_plain_pytorch(in_place):
    torch.manual_seed(1)
    x0 = torch.randn(3, 4, 8, dtype=torch.float64)
    r0 = torch.randn(3, 4, 8, dtype=torch.float64)
    dy = torch.randn(3, 4, 8, dtype=torch.float64)

    x, r = leaf(x0), leaf(r0)
    # the extra input is an intermediate, as a residual stream is
    residual = r * 3.0
    y = ops.AddExtraInput(in_place=in_place)(x * 2.0, residual)
    torch.autograd.backward(y.tanh(), dy)

    xe, re = leaf(x0), leaf(r0)
    ye = xe * 2.0 + re * 3.0
    torch.autograd.backward(ye.tanh(), dy)

    assert torch.equal(y, ye)
    assert torch.equal(x.grad, xe.grad) and torch.equal(r.grad, re.grad)
    assert (y.data_ptr() == residual.data_ptr()) == in_place


def test_add_extra_input_in_place_overwrites_the_extra_input():
    x = torch.tensor([1.0, 2.0, 3.0])
    extra = torch.tensor([10.0, 20.0, 30.0])
    y = ops.AddExtraInput(in_place=True)(x, extra)
    expected = torch.tensor([11.0, 22.0, 33.0])
    assert torch.equal(y, expected) and torch.equal(extra, expected)
    assert y.data_ptr() == extra.data_ptr()
    # the out-of-place operation leaves it alone
    extra = torch.tensor([10.0, 20.0, 30.0])
    y = ops.AddExtraInput()(x, extra)
    assert torch.equal(extra, torch.tensor([10.0, 20.0, 30.0])) and torch.equal(y, expected)


def test_add_extra_input_in_place_keeps_the_extra_dtype():
    torch.manual_seed(2)
    x = torch.randn(4, 8, requires_grad=True)
    extra0 = torch.randn(4, 8).to(torch.bfloat16)
    y = ops.AddExtraInput(in_place=True)(x, extra0.clone())
    assert y.dtype == torch.bfloat16
    # the sum is formed in float32 and rounded once into the bfloat16 storage
    assert torch.equal(y, (extra0.float() + x.detach()).bfloat16())
    dy = torch.randn(4, 8, dtype=torch.bfloat16)
    y.backward(dy)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, dy.float())


def test_add_extra_input_in_place_inside_a_sequence():
    torch.manual_seed(3)
    linear = ops.Linear(8, 8, device="cpu")
    seq = ops.Sequential(linear, ops.AddExtraInput(in_place=True), ops.ConstantScale(0.5))
    x0, r0, dy = torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8)
    x, r = leaf(x0), leaf(r0)
    y = seq(x, r + 0.0)
    y.backward(dy)

    xe, re = leaf(x0), leaf(r0)
    ye = (torch.nn.functional.linear(xe, linear.weight, linear.bias) + re) * 0.5
    ye.backward(dy)
    torch.testing.assert_close(y, ye, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r.grad, re.grad, rtol=1e-6, atol=1e-6)


def test_add_extra_input_in_place_is_seen_by_autograd():
    # A tensor another node saved is overwritten by the in-place add: autograd's version
    # check refuses the backward instead of computing with the new values.
    a = torch.randn(4, requires_grad=True)
    extra = a * 1.0
    squared = extra * extra  # saves `extra`
    y = ops.AddExtraInput(in_place=True)(torch.randn(4), extra)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (squared.sum() + y.sum()).backward()


def test_add_extra_input_broadcasting():
    torch.manual_seed(4)
    x0, b0, dy = (
        torch.randn(3, 8, dtype=torch.float64),
        torch.randn(8, dtype=torch.float64),
        torch.randn(3, 8, dtype=torch.float64),
    )
    x, b = leaf(x0), leaf(b0)
    y = ops.AddExtraInput()(x, b)
    y.backward(dy)
    assert torch.equal(y, x0 + b0)
    assert torch.equal(x.grad, dy) and torch.allclose(b.grad, dy.sum(0))
    # in place, the extra input must already hold the sum's shape
    with pytest.raises(
        ValueError, match=r"extra input has shape \(8,\) but the sum has shape \(3, 8\)"
    ):
        ops.AddExtraInput(in_place=True)(x, b.detach().clone())
    # a smaller input broadcasts into it
    extra = torch.randn(3, 8, dtype=torch.float64)
    expected = extra + b0
    y = ops.AddExtraInput(in_place=True)(b, extra)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("branch_grad", ["dense", "broadcast", "unused"])
def test_make_extra_output_matches_plain_pytorch(in_place, branch_grad):
    torch.manual_seed(5)
    x0 = torch.randn(4, 8, dtype=torch.float64)
    dy = torch.randn(4, 8, dtype=torch.float64)

    def branch_loss(t):
        if branch_grad == "dense":
            return (t * t).sum()
        if branch_grad == "broadcast":
            return t.sum() * 3.0  # autograd hands down an expanded (zero-stride) gradient
        return None

    x = leaf(x0)
    out, branch = ops.MakeExtraOutput(in_place=in_place)(x * 2.0)
    assert torch.equal(out, x0 * 2.0) and torch.equal(branch, x0 * 2.0)
    loss = (out * dy).sum()
    if branch_grad != "unused":
        loss = loss + branch_loss(branch)
    loss.backward()

    xe = leaf(x0)
    h = xe * 2.0
    loss_e = (h * dy).sum()
    if branch_grad != "unused":
        loss_e = loss_e + branch_loss(h)
    loss_e.backward()
    assert torch.equal(x.grad, xe.grad)


def test_make_extra_output_in_place_gives_the_same_bits():
    torch.manual_seed(6)
    x0 = torch.randn(16, 32, dtype=torch.bfloat16)
    dy, db = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    grads = []
    for in_place in (False, True):
        x = leaf(x0)
        out, branch = ops.MakeExtraOutput(in_place=in_place)(x)
        torch.autograd.backward([out, branch], [dy.clone(), db.clone()])
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0], dy + db)


@pytest.mark.parametrize("cls", [ops.AddExtraInput, ops.MakeExtraOutput])
def test_in_place_must_be_a_bool(cls):
    assert cls().in_place is False and cls(in_place=True).in_place is True
    with pytest.raises(TypeError, match="in_place must be a bool, got 'yes'"):
        cls(in_place="yes")
