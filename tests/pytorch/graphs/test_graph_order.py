"""``make_graphed_callables(_order=...)``: one pair of graphs per layer and microbatch, captured
in a pipeline schedule's order (Megatron-LM's), against the same layers run eagerly.

The oracle is the eager path: two copies of the layers built from the same seed; each training
iteration runs the schedule (forwards of chunk ``c``'s next microbatch for ``+c``, backwards of
its oldest open one for ``-c``), graphed through the returned functions and eagerly through the
modules, and every microbatch's output and input gradient, the accumulated parameter gradients
and the FP8 state must be bit for bit the same. The layout of ``sample_args`` and the capture
order are checked against lists written out by hand; the argument errors on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import DTYPE, TOKENS, H, assert_same, fp8_state, sgd
from utils import make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch._graph_schedule import Schedule
from transformer_engine.pytorch.graph import make_graphed_callables

# Two model chunks: chunk 1 one layer, chunk 2 two; three microbatches, interleaved.
ORDER = [1, 2, 1, -2, 2, -1, 1, -2, 2, -1, -2, -1]
LAYERS = [1, 2]
MICROBATCHES = 3


# -- CPU: the schedule and the argument rules ---------------------------------------------------
def test_layout_and_capture_order_of_a_schedule():
    s = Schedule(3, ORDER, LAYERS)
    # sample_args: chunk 1 (callable 0) x 3 microbatches, then chunk 2 (callables 1, 2) x 3
    assert s.entries == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (5, 1), (6, 2), (7, 1), (8, 2)]
    f = lambda *entries: [(True, e) for e in entries]  # noqa: E731
    b = lambda *entries: [(False, e) for e in entries]  # noqa: E731
    assert s.plan == (
        f(0) + f(3, 4) + f(1) + b(4, 3) + f(5, 6) + b(0) + f(2) + b(6, 5) + f(7, 8) + b(1)
        + b(8, 7) + b(2)
    )  # fmt: skip
    assert s.num_microbatches == MICROBATCHES and s.num_samples == 9


def test_equal_chunks_by_default_and_no_order():
    s = Schedule(4, [1, 2, -2, -1])
    assert s.entries == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert s.plan == [(True, 0), (True, 1), (True, 2), (True, 3),
                      (False, 3), (False, 2), (False, 1), (False, 0)]  # fmt: skip
    plain = Schedule(2)
    assert not plain.ordered and plain.entries == [(0, 0), (1, 1)]
    assert plain.plan == [(True, 0), (True, 1), (False, 1), (False, 0)]


def test_weight_gradient_steps_follow_their_backwards_and_change_no_capture():
    order = [1, 2, -2, -2.5, 1, -1, -1.5, 2, -2, -1, -1.5, -2.5]
    s = Schedule(2, order)
    assert s.num_microbatches == 2
    assert s.plan == Schedule(2, [s for s in order if s == int(s)]).plan


def cpu_layers(n=3) -> tuple:
    return tuple(te.Linear(32, 32, device="cpu") for _ in range(n))


def samples(n) -> tuple:
    return tuple((torch.randn(16, 32),) for _ in range(n))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(_order=[1, 0, -1]), ValueError, "holds 0; each step is a nonzero int"),
        (dict(_order=[1, True]), ValueError, "holds True"),
        (dict(_order=[1, 1.5, -1]), ValueError, "holds 1.5; each step is a nonzero int"),
        (dict(_order=[1, -0.5, -1]), ValueError, "weight-gradient step of chunk 0"),
        (
            dict(_order=[1, -1.5, -1]),
            ValueError,
            "weight-gradient step number 1 of chunk 1, which has had only 0 backward",
        ),
        (dict(_order=[1, 1, -1, -1.5, -1]), ValueError, r"per chunk are \[1\]; a chunk has one"),
        (dict(_order=[-1.5]), ValueError, "weight-gradient steps only"),
        (dict(_order=[]), ValueError, "_order is empty"),
        (dict(_order="1-1"), ValueError, "must be a list of chunk numbers"),
        (dict(_order=[-1, 1]), ValueError, "backward number 1 of chunk 1, which has had only 0"),
        (dict(_order=[1, 1, -1]), ValueError, r"forwards \[2\] and backwards \[1\]"),
        (dict(_order=[2, -2]), ValueError, r"forwards \[0, 1\]"),
        (dict(_order=[1, 2, -2, -1]), ValueError, "3 callables do not split evenly"),
        (dict(_order=[1, 2, -2, -1], _num_layers_per_chunk=[1, 1]), ValueError, "summing to"),
        (dict(_order=[1, 2, -2, -1], _num_layers_per_chunk=[3]), ValueError, "must give 2"),
        (dict(_order=[1, 2, -2, -1], _num_layers_per_chunk=[0, 3]), ValueError, "positive"),
    ],
)
def test_order_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_graphed_callables(cpu_layers(), samples(3), **kwargs)


def test_sample_args_count_follows_the_schedule():
    with pytest.raises(ValueError, match=r"3 sample_args for 9 graphs \(3 callables x 3 micro"):
        make_graphed_callables(cpu_layers(), samples(3), _order=ORDER, _num_layers_per_chunk=LAYERS)
    with pytest.raises(ValueError, match="2 capture_time_hooks for 3 callables"):
        make_graphed_callables(cpu_layers(), samples(9), _order=ORDER,
                               _num_layers_per_chunk=LAYERS, capture_time_hooks=(None, None))  # fmt: skip
    # the right counts get as far as the device check
    with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
        make_graphed_callables(cpu_layers(), samples(9), _order=ORDER, _num_layers_per_chunk=LAYERS,
                               _reuse_graph_input_output_buffers=True)  # fmt: skip


# -- GPU: graphed == eager over the schedule ------------------------------------------------------
def build(device) -> list:
    torch.manual_seed(1234)
    kw = dict(params_dtype=DTYPE, device=device)
    return [te.LayerNormLinear(H, H, **kw), te.Linear(H, H, **kw), te.LayerNormMLP(H, 2 * H, **kw)]


def batches(device, seed) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        [tuple(torch.randn(TOKENS, H, generator=g).to(device, DTYPE) for _ in range(2))
         for _ in range(MICROBATCHES)]
        for _ in LAYERS
    ]  # fmt: skip


def chunk_callables(c: int) -> range:
    return range(sum(LAYERS[:c]), sum(LAYERS[: c + 1]))


def run_schedule(forward, data, recipe, caching) -> list:
    """One iteration of ORDER: per microbatch its output (at its forward) and input gradient."""
    results, open_batches, fwd, bwd = [], {}, [0, 0], [0, 0]
    for step in ORDER:
        c = abs(step) - 1
        if step > 0:
            m, fwd[c] = fwd[c], fwd[c] + 1
            x = data[c][m][0].clone().requires_grad_(True)
            kwargs = {"is_first_microbatch": m == 0} if caching else {}
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = forward(c, m, x, kwargs)
            results.append(y.detach().clone())
            open_batches[c, m] = (x, y)
        else:
            m, bwd[c] = bwd[c], bwd[c] + 1
            x, y = open_batches.pop((c, m))
            y.backward(data[c][m][1])
            results.append(x.grad.clone())
    return results


def entry(c, m, layer):  # sample_args' layout: chunk, microbatch, layer
    return sum(LAYERS[:c]) * MICROBATCHES + m * LAYERS[c] + layer


def capture_schedule(graphed, device, recipe, caching, reuse=False) -> tuple:
    sample_args = tuple(
        (torch.randn(TOKENS, H, device=device, dtype=DTYPE, requires_grad=True),)
        for _ in range(sum(LAYERS) * MICROBATCHES)
    )
    return make_graphed_callables(
        tuple(graphed), sample_args, _order=ORDER, _num_layers_per_chunk=LAYERS,
        enabled=recipe is not None, recipe=recipe, cache_quantized_params=caching,
        _reuse_graph_input_output_buffers=reuse,
    )  # fmt: skip


@needs_cuda
@pytest.mark.parametrize(
    "recipe_name, caching, reuse",
    [
        ("high_precision", False, False),
        ("delayed", False, False),
        ("current", False, False),
        ("delayed", True, False),
        ("high_precision", False, True),
        ("current", False, True),
        ("delayed", True, True),
    ],
)
def test_scheduled_graphs_match_eager(recipe_name, caching, reuse):
    """With ``_reuse_graph_input_output_buffers`` too: the shared static tensors
    (``test_graph_reuse_buffers.py``) change no result."""
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = make_recipe(recipe_name)
    eager, graphed = build(device), build(device)
    functions = capture_schedule(graphed, device, recipe, caching, reuse)
    assert isinstance(functions, tuple) and len(functions) == sum(LAYERS) * MICROBATCHES
    assert all("forward" not in m.__dict__ for m in graphed)  # the modules stay eager

    def graphed_forward(c, m, x, kwargs):
        for layer in range(LAYERS[c]):
            x = functions[entry(c, m, layer)](x, **kwargs)
        return x

    def eager_forward(c, m, x, kwargs):
        for i in chunk_callables(c):
            x = eager[i](x, **kwargs)
        return x

    for iteration in range(3):
        data = batches(device, seed=iteration)
        assert_same(
            run_schedule(eager_forward, data, recipe, caching),
            run_schedule(graphed_forward, data, recipe, caching),
            f"iteration {iteration}",
        )
        for i, (a, b) in enumerate(zip(eager, graphed)):
            assert_same(sgd(a), sgd(b), f"iteration {iteration} layer {i} parameter gradients")
            assert_same(fp8_state(a), fp8_state(b), f"iteration {iteration} layer {i} FP8 state")

    # reset(): that function's layer runs eagerly again, the others still replay
    functions[0].reset()
    x = batches(device, seed=9)[0][0][0]
    kwargs = {"is_first_microbatch": True} if caching else {}
    with torch.no_grad(), te.autocast(enabled=recipe is not None, recipe=recipe):
        assert_same([eager[0](x, **kwargs)], [functions[0](x, **kwargs)], "after reset")


# each backward followed by its weight-gradient step; or with other steps between them (the
# chunk-2 weight gradients of microbatch 0 after chunk 1's backward)
WGRAD_ORDERS = {
    "right_after": [1, 2, -2, -2.5, 1, -1, -1.5, 2, -2, -2.5, -1, -1.5],
    "later": [1, 2, -2, 1, -1, -2.5, -1.5, 2, -2, -2.5, -1, -1.5],
}


@needs_cuda
@pytest.mark.parametrize(
    "recipe_name, order_name, reuse",
    [
        ("high_precision", "right_after", False),
        ("delayed", "right_after", False),
        ("high_precision", "later", False),
        ("high_precision", "later", True),
        ("delayed", "later", True),
    ],
)
def test_weight_gradient_steps_replay_deferred_wgrads_where_the_schedule_puts_them(
    recipe_name, order_name, reuse
):
    """``delay_wgrad_compute`` layers in a schedule with weight-gradient steps (``-c.5``): at
    each, the chunk's graphed functions' ``backward_dw()`` replay that microbatch's deferred
    GEMMs, as the eager modules' ``backward_dw()`` run theirs; every output, input gradient and
    the accumulated weight gradients bit for bit the same. With
    ``_reuse_graph_input_output_buffers`` too: the weight-gradient graphs read their output
    gradients after other backwards ran, so those are not shared."""
    order = WGRAD_ORDERS[order_name]
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = make_recipe(recipe_name)

    def layers():
        torch.manual_seed(1234)
        kw = dict(params_dtype=DTYPE, device=device, delay_wgrad_compute=True)
        return [te.Linear(H, H, **kw), te.LayerNormMLP(H, 2 * H, **kw)]

    eager, graphed = layers(), layers()
    samples = tuple((torch.randn(TOKENS, H, device=device, dtype=DTYPE, requires_grad=True),)
                    for _ in range(4))  # fmt: skip
    functions = make_graphed_callables(tuple(graphed), samples, _order=order,
                                       enabled=recipe is not None, recipe=recipe,
                                       allow_unused_input=True,
                                       _reuse_graph_input_output_buffers=reuse)  # fmt: skip
    for iteration in range(2):
        g = torch.Generator().manual_seed(iteration)
        data = [[tuple(torch.randn(TOKENS, H, generator=g).to(device, DTYPE) for _ in range(2))
                 for _ in range(2)] for _ in range(2)]  # fmt: skip
        runs = [
            run_with_wgrad_steps(order, data, recipe, lambda c, m, x: eager[c](x),
                                 lambda c, m: eager[c].backward_dw(), eager),
            run_with_wgrad_steps(order, data, recipe, lambda c, m, x: functions[2 * c + m](x),
                                 lambda c, m: functions[2 * c + m].backward_dw(), graphed),
        ]  # fmt: skip
        assert_same(runs[0], runs[1], f"iteration {iteration}")
        assert runs[0][3] is None, "the weight gradient was not deferred"
        for i, (a, b) in enumerate(zip(eager, graphed)):
            assert_same(sgd(a), sgd(b), f"iteration {iteration} layer {i} parameter gradients")


def run_with_wgrad_steps(order, data, recipe, forward, backward_dw, modules) -> list:
    """One iteration of ``order``: each forward's output; each backward's input gradient and
    the chunk's first weight gradient right after it (None while deferred)."""
    results, open_batches, counts = [], {}, {}
    for step in order:
        kind = "forward" if step > 0 else "backward" if step == int(step) else "wgrad"
        c = (abs(step) if kind != "wgrad" else -int(step)) - 1
        m = counts.get((kind, c), 0)
        counts[kind, c] = m + 1
        if kind == "forward":
            x = data[c][m][0].clone().requires_grad_(True)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                y = forward(c, m, x)
            results.append(y.detach().clone())
            open_batches[c, m] = (x, y)
        elif kind == "backward":
            x, y = open_batches.pop((c, m))
            y.backward(data[c][m][1])
            weight = next(modules[c].parameters()) if c == 0 else modules[c].fc1_weight
            results += [x.grad.clone(), None if weight.grad is None else weight.grad.clone()]
        else:
            backward_dw(c, m)
    return results
