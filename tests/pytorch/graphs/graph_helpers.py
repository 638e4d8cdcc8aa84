"""What the graph tests share: the layer size and dtype, and the eager-vs-graphed comparisons
(bit for bit: a replay runs the kernels the eager step runs)."""

from __future__ import annotations

import torch
from utils import bitwise_equal

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

H, TOKENS, LR = 128, 64, 0.25
DTYPE = torch.bfloat16


def cuda_device() -> torch.device:
    """The current CUDA device, with its index (a bare ``cuda`` compares unequal to it)."""
    return torch.device("cuda", torch.cuda.current_device())


def fp8_state(model) -> list:
    """Every delayed-scaling tensor of the model's TE modules, cloned."""
    out = []
    for m in model.modules():
        if isinstance(m, TransformerEngineBaseModule) and m.fp8_meta_tensors_initialized:
            for key in ("scaling_fwd", "scaling_bwd"):
                state = m.fp8_meta[key].delayed_scaling_state()
                if state is not None:
                    out += [state.scale.clone(), state.amax_history.clone()]
    return out


def sgd(model) -> list:
    """The step's parameter gradients (cloned; ``main_grad`` where a parameter has one, which is
    left as it is), then ``p -= LR * grad`` and no ``.grad``."""
    grads = []
    with torch.no_grad():
        for p in model.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            grads.append(None if g is None else g.clone())
            if g is not None:
                p.sub_(LR * g.to(p.dtype))
            p.grad = None
    return grads


def assert_same(eager: list, graphed: list, what: str) -> None:
    assert len(eager) == len(graphed), what
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert (a is None) == (b is None), f"{what}[{i}]"
        assert a is None or bitwise_equal(a, b), f"{what}[{i}] differs"
