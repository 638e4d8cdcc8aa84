"""te.ops.register_forward_backward_fusion: a joint fusion's operation runs both passes (its
backward reads what only its own forward saved), the forward-only and backward-only fusions
still apply around it, and the fused chain gives the same bits as the unfused one."""

import pytest
import torch

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops import OperationFuser
from transformer_engine.pytorch.ops.fused.backward_activation_bias import BackwardActivationBias
from transformer_engine.pytorch.ops.fused.forward_linear_bias_activation import (
    ForwardLinearBiasActivation,
)


class _ScaleReLU(ops.FusedOperation):
    """``relu(scale * x)`` in one pass. The forward keeps a private mask that the ReLU's own
    backward knows nothing about, so this backward must be the one that runs."""

    calls = {"forward": 0, "backward": 0}

    def fuser_forward(self, basic_op_ctxs, input_, **kwargs):
        _ScaleReLU.calls["forward"] += 1
        y = torch.relu(input_ * self.basic_ops[0].scale)
        if basic_op_ctxs[1].requires_grad:
            basic_op_ctxs[1].save_for_backward(y > 0)
        return y, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, **kwargs):
        _ScaleReLU.calls["backward"] += 1
        (mask,) = basic_op_ctxs[1].saved_tensors
        grad = grad_output * mask * self.basic_ops[0].scale
        return grad, [[], []], [(), ()]


def _fuse_scale_relu(ops_list, *, recipe):
    out, i = [], 0
    while i < len(ops_list):
        pair = ops_list[i : i + 2]
        if len(pair) == 2 and type(pair[0]) is ops.ConstantScale and type(pair[1]) is ops.ReLU:
            out.append(_ScaleReLU(pair))
            i += 2
        else:
            out.append(ops_list[i])
            i += 1
    return out


@pytest.fixture
def joint_registry(monkeypatch):
    """A fresh joint-fusion list for each test (the registries are class-level)."""
    monkeypatch.setattr(OperationFuser, "forward_backward_fusion_functions", [])
    _ScaleReLU.calls.update(forward=0, backward=0)


def _model():
    torch.manual_seed(41)
    model = ops.Sequential(
        ops.Linear(16, 16, device="cpu"),
        ops.GELU(),
        ops.ConstantScale(2.0),
        ops.ReLU(),
    )
    with torch.no_grad():
        model[0].bias.normal_()
    return model


def _run(model, x, dy):
    x = x.clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def test_joint_fusion_runs_both_passes_with_the_same_bits(joint_registry):
    model = _model()
    x, dy = torch.randn(8, 16), torch.randn(8, 16)
    unfused = _run(model, x, dy)

    ops.register_forward_backward_fusion(_fuse_scale_relu)
    fused = _run(model, x, dy)
    assert _ScaleReLU.calls == {"forward": 1, "backward": 1}
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)

    # the forward-only and backward-only fusions still apply to the other operations
    (fuser,) = model._get_module_groups()
    assert [type(op) for op, _ in fuser._forward_ops] == [ForwardLinearBiasActivation, _ScaleReLU]
    assert [type(op) for op, _ in fuser._backward_ops] == [
        ops.BasicLinear,
        BackwardActivationBias,
        _ScaleReLU,
    ]
    (joint,) = [op for op, _ in fuser._forward_ops if type(op) is _ScaleReLU]
    assert any(op is joint for op, _ in fuser._backward_ops)

    # against the same arithmetic in plain PyTorch
    xe = x.clone().requires_grad_()
    linear = model[0]
    ye = torch.relu(
        2.0 * torch.nn.functional.gelu(xe @ linear.weight.T + linear.bias, approximate="tanh")
    )
    ye.backward(dy)
    torch.testing.assert_close(fused[0], ye.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1], xe.grad, rtol=1e-5, atol=1e-6)


def test_joint_fusion_without_backward(joint_registry):
    ops.register_forward_backward_fusion(_fuse_scale_relu)
    model = ops.Sequential(ops.ConstantScale(-1.5), ops.ReLU())
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = model(x)
    assert torch.equal(y, torch.relu(x * -1.5))
    assert _ScaleReLU.calls == {"forward": 1, "backward": 0}


def test_a_one_pass_fusion_may_not_absorb_a_joint_fused_operation(joint_registry, monkeypatch):
    monkeypatch.setattr(OperationFuser, "forward_fusion_functions", [])
    ops.register_forward_backward_fusion(_fuse_scale_relu)

    def regroup_everything(ops_list, *, recipe):
        basic = [b for op in ops_list for b in (op.basic_ops if op.is_fused_op else [op])]
        return [ops.FusedOperation(basic)]

    ops.register_forward_fusion(regroup_everything)
    model = ops.Sequential(ops.ConstantScale(2.0), ops.ReLU())
    with pytest.raises(RuntimeError, match="absorbed _ScaleReLU.*forward-backward fusion"):
        model(torch.randn(2, 2))


def test_registration_order_and_duplicates(joint_registry):
    def first(ops_list, *, recipe):
        return ops_list

    def second(ops_list, *, recipe):
        return ops_list

    ops.register_forward_backward_fusion(second)
    ops.register_forward_backward_fusion(first, prepend=True)
    ops.register_forward_backward_fusion(second)  # registered once only
    assert OperationFuser.forward_backward_fusion_functions == [first, second]
    with pytest.raises(TypeError, match="must be callable"):
        ops.register_forward_backward_fusion("not a function")
