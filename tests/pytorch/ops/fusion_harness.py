"""What the tests of the te.ops FP8 producer fusions share: a few training steps with every
result collected, the fuser's plan, the same model with some fusions switched off, and the
bytes autograd keeps for backward."""

from __future__ import annotations

import contextlib

import torch
from utils import autocast_by_name

from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear
from transformer_engine.pytorch.ops.fuser import OperationFuser


def run(model, x, dy, recipe, steps=2):
    """Outputs, input gradient, parameter gradients and (delayed scaling) the linears' scales
    and amax histories after each of ``steps`` steps."""
    results = []
    for _ in range(steps):
        xs = x.detach().clone().requires_grad_(True)
        for p in model.parameters():
            p.grad = None
        with autocast_by_name(recipe):
            y = model(xs)
        y.backward(dy)
        results += [("out", y.detach().clone()), ("dx", xs.grad)]
        results += [(name, p.grad) for name, p in model.named_parameters()]
        for i, op in enumerate(o for o in model.modules() if type(o) is BasicLinear):
            for mode in ("forward", "backward"):
                state = op.recipe_state(mode)
                if state is not None and hasattr(state, "amax_history"):
                    results.append((f"scale{i}{mode}", state.scale.clone()))
                    results.append((f"amax{i}{mode}", state.amax_history.clone()))
    return results


def fuser_of(model):
    """The one fuser of a ``Sequential`` of operations."""
    (fuser,) = model._get_module_groups()
    return fuser


def plan(fuser, which):
    """``[(operation class name, basic-op indices)]`` of the fuser's ``which`` pass
    (``"forward"`` or ``"backward"``)."""
    return [(type(op).__name__, idxs) for op, idxs in getattr(fuser, f"_{which}_ops")]


@contextlib.contextmanager
def fusions_off(monkeypatch, *functions):
    """Inside: the fuser without the fusion ``functions`` (each registered forward or
    backward; the other fusions stay on)."""
    forward = list(OperationFuser.forward_fusion_functions)
    backward = list(OperationFuser.backward_fusion_functions)
    for function in functions:
        assert function in forward or function in backward, function
    with monkeypatch.context() as patch:
        patch.setattr(
            OperationFuser, "forward_fusion_functions", [f for f in forward if f not in functions]
        )
        patch.setattr(
            OperationFuser, "backward_fusion_functions", [f for f in backward if f not in functions]
        )
        yield


def saved(model, x, recipe):
    """``(bytes, [(shape, dtype)])`` of what autograd keeps for ``model(x)`` under ``recipe``,
    parameters left out (a quantized tensor counts as its data, transpose and scale buffers)."""
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes, kinds = {}, []

    def pack(tensor):
        inner = [getattr(tensor, n, None) for n in ("_data", "_transpose", "_scale_inv")]
        for buffer in [t for t in inner if isinstance(t, torch.Tensor)] or [tensor]:
            address = buffer.untyped_storage().data_ptr()
            if address and address not in excluded:
                sizes[address] = buffer.untyped_storage().nbytes()
                kinds.append((tuple(buffer.shape), buffer.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_by_name(recipe):
        out = model(x)
    del out
    return sum(sizes.values()), kinds
