"""``make_graphed_callables(_order=..., _reuse_graph_input_output_buffers=True)``: which static
tensors the graphs of a schedule share, and what the sharing must leave intact.

That the shared tensors change no result is ``test_graph_order.py``'s scheduled test, run with
the flag against the eager layers. Here: the sharing itself (by address: a layer reads the
previous layer's output and hands it its input gradient; a chunk's later microbatch reads the
first input of one whose backward has run; one output-gradient buffer per kind for every other
backward), the memory it gives back (the sample arguments no graph reads any more), a tensor
other than the shared output copied in with a warning, and an input gradient that stays valid
until its own graph replays again although its layer passes the shared gradient buffer
through.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from graph_helpers import DTYPE, TOKENS, H, cuda_device
from test_graph_order import LAYERS, MICROBATCHES, ORDER, build, capture_schedule, entry
from utils import bitwise_equal, make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch import _graph_buffers
from transformer_engine.pytorch.graph import make_graphed_callables


def captured_of(function):
    """The captured graphs behind a returned function (``reset`` is a bound method of the
    callable's graph record)."""
    return function.reset.__self__.captured


def activation(requires_grad=False) -> torch.Tensor:
    return torch.randn(TOKENS, H, device=cuda_device(), dtype=DTYPE, requires_grad=requires_grad)


@needs_cuda
@pytest.mark.parametrize("caching", [False, True])
def test_layers_share_their_boundary_and_backwards_their_gradient_buffers(caching):
    functions = capture_schedule(
        build(cuda_device()), cuda_device(), make_recipe("delayed"), caching, True
    )
    others = set()  # the output-gradient buffers that no layer boundary gives
    for m in range(MICROBATCHES):
        a, b = captured_of(functions[entry(1, m, 0)]), captured_of(functions[entry(1, m, 1)])
        assert b.shared_input and b.static_inputs[0].data_ptr() == a.outputs[0].data_ptr()
        assert a.grad_outputs[0].data_ptr() == b.grad_inputs[0].data_ptr()
        others.add(b.grad_outputs[0].data_ptr())
        v = captured_of(functions[entry(0, m, 0)])
        assert not v.shared_input  # a chunk's first layer reads no other layer's output
        others.add(v.grad_outputs[0].data_ptr())
    assert len(others) == 1, "every backward's (TOKENS, H) output gradient shares one buffer"

    # a chunk's first input: a later microbatch's forward takes the buffer of a microbatch whose
    # backward has run (ORDER: chunk 2 runs one microbatch at a time; chunk 1's third forward
    # follows its first backward, its second forward does not)
    def first_inputs(c) -> list:
        return [
            captured_of(functions[entry(c, m, 0)]).static_inputs[0].data_ptr()
            for m in range(MICROBATCHES)
        ]

    chunk1, chunk2 = first_inputs(0), first_inputs(1)
    assert len(set(chunk2)) == 1
    assert chunk1[2] == chunk1[0] != chunk1[1]


@needs_cuda
@pytest.mark.parametrize("reuse", [False, True])
def test_the_graphs_let_go_of_the_sample_arguments_they_do_not_read(reuse):
    layers = tuple(build(cuda_device()))
    samples = tuple((activation(requires_grad=True),) for _ in range(sum(LAYERS) * MICROBATCHES))
    functions = make_graphed_callables(layers, samples, _order=ORDER, _num_layers_per_chunk=LAYERS,
                                       _reuse_graph_input_output_buffers=reuse)  # fmt: skip
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    del samples
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    # with the flag the second layer of chunk 2 reads the first's output in every microbatch,
    # chunk 2's first layer one buffer for all three microbatches, chunk 1's two
    shared = MICROBATCHES + 2 + 1 if reuse else 0
    assert freed == shared * TOKENS * H * torch.finfo(DTYPE).bits // 8
    assert len(functions) == len(layers) * MICROBATCHES


@needs_cuda
def test_another_tensor_for_a_shared_input_is_copied_in_with_a_warning(monkeypatch):
    monkeypatch.setattr(_graph_buffers, "_warned", False)
    eager, graphed = build(cuda_device()), build(cuda_device())
    functions = capture_schedule(graphed, cuda_device(), None, False, reuse=True)
    first, second = functions[entry(1, 0, 0)], functions[entry(1, 0, 1)]
    x = activation(requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the output itself: no copy, no warning
        out = second(first(x))
    assert bitwise_equal(out, eager[2](eager[1](x)))
    y = first(x)
    z = (y * 2).detach()
    with pytest.warns(RuntimeWarning, match="overwrites the output the previous layer"):
        out = second(z)
    assert bitwise_equal(out, eager[2](z))
    assert torch.equal(y, z), "the documented overwrite: the earlier output now holds z"


class PassThrough(torch.nn.Module):
    """Hands its input on as a view: its input gradient is its output gradient's buffer."""

    def forward(self, x):
        return x.view_as(x)


@needs_cuda
def test_an_input_gradient_stays_until_its_own_graph_replays_again():
    """Chunk 1 passes the gradient through, chunk 2 is a te.Linear; both backwards read the
    shared (TOKENS, H) output-gradient buffer. Microbatch 0's input gradient must survive
    microbatch 1's chunk-2 backward, which writes that buffer."""
    order = [1, 2, -2, -1, 1, 2, -2, -1]
    layers = (PassThrough(), te.Linear(H, H, params_dtype=DTYPE, device=cuda_device()))
    samples = tuple((activation(requires_grad=True),) for _ in range(4))
    functions = make_graphed_callables(layers, samples, _order=order,
                                       _reuse_graph_input_output_buffers=True)  # fmt: skip
    kept = []
    for m in range(2):  # functions: chunk 1's microbatches 0, 1, then chunk 2's
        x, dy = activation(requires_grad=True), activation()
        y = functions[m](x)
        functions[2 + m](activation(requires_grad=True)).backward(activation())
        y.backward(dy)
        kept.append((x.grad, dy))
    torch.cuda.synchronize()
    for m, (grad, dy) in enumerate(kept):
        assert torch.equal(grad, dy), f"microbatch {m}'s input gradient was overwritten"
