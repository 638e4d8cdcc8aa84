"""Replays on a side stream: upstream's replay keywords ``cuda_graph_stream`` and
``cuda_graph_event`` of a graphed callable.

Oracles: the same modules run eagerly on the calling stream (bit for bit, as every graph test);
for the ordering, kernels that sleep on the GPU (``torch.cuda._sleep``) inside the graph or on the
calling stream, so that a missing wait between the two streams reads stale tensors or lets the
calling stream run ahead, which the tests observe.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from graph_helpers import DTYPE, TOKENS, H, assert_same, cuda_device, fp8_state, sgd
from test_make_graphed_callables import build, data, static_sample, step
from utils import bitwise_equal, make_recipe, needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.pytorch._graph_streams import ReplayStream
from transformer_engine.pytorch.graph import make_graphed_callables

SLEEP_CYCLES = 200_000_000  # about 0.1 s of one SM's clock: long against everything else here


# -- CPU: the keywords' checks ----------------------------------------------------------------
def test_no_replay_keywords_leave_the_call_as_it_is():
    kwargs = {"is_first_microbatch": True}
    assert ReplayStream.take(kwargs, torch.device("cuda", 0), "graphed") is None
    assert kwargs == {"is_first_microbatch": True}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cuda_graph_event": 3}, "cuda_graph_event must be a torch.cuda.Event"),
        ({"cuda_graph_stream": "side"}, "cuda_graph_stream must be a torch.cuda.Stream"),
        ({"cuda_graph_stream": torch.Stream(device="cpu")}, "must be a torch.cuda.Stream"),
    ],
)
def test_replay_keywords_of_the_wrong_kind_are_refused(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ReplayStream.take(dict(kwargs), torch.device("cuda", 0), "graphed Linear")


# -- GPU ---------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed", "current"])
@pytest.mark.parametrize("kind", ["linear", "stack"])
def test_side_stream_replays_match_eager(kind, recipe_name):
    """Forward and backward replayed on a side stream: outputs, gradients and FP8 state as the
    eager module's, step after step (the calling stream orders the steps' copies and updates)."""
    device, recipe = cuda_device(), make_recipe(recipe_name)
    eager, graphed = build(kind, device), build(kind, device)
    make_graphed_callables(
        graphed, (static_sample(device),), enabled=recipe is not None, recipe=recipe
    )
    side = torch.cuda.Stream(device=device)
    for i, (x, dy) in enumerate(data(device, 5)):
        assert_same(
            step(eager, x, dy, recipe), step(graphed, x, dy, recipe, cuda_graph_stream=side),
            f"step {i}",
        )  # fmt: skip
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")


class _SleepThenLinear(torch.nn.Module):
    """A te.Linear whose forward and backward each start with a long GPU sleep, so that what
    the graph writes arrives late."""

    class _SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            torch.cuda._sleep(SLEEP_CYCLES)
            return dy

    def __init__(self, device, event: torch.cuda.Event | None = None) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.linear = te.Linear(H, H, params_dtype=DTYPE, device=device)
        self.event = event

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        y = self._SleepInBackward.apply(self.linear(x))  # its backward sleeps before dgrad
        if self.event is not None:  # recorded by the graph once y is written
            self.event.record()
            torch.cuda._sleep(SLEEP_CYCLES)
        return y


@needs_cuda
def test_side_stream_replay_is_ordered_with_the_calling_stream():
    """The side stream waits for the calling stream (an input written there late is the one the
    graph reads) and the calling stream for the side stream (outputs and gradients read right
    after the call are this replay's, not the previous one's)."""
    device = cuda_device()
    reference = build("linear", device)
    graphed = _SleepThenLinear(device)
    make_graphed_callables(graphed, (static_sample(device),), num_warmup_iters=1)
    side = torch.cuda.Stream(device=device)
    for i, (x_new, dy) in enumerate(data(device, 3)):
        x = torch.zeros_like(x_new, requires_grad=True)
        torch.cuda._sleep(SLEEP_CYCLES)  # the calling stream writes the input late
        with torch.no_grad():
            x.copy_(x_new)
        y = graphed(x, cuda_graph_stream=side)
        y_now = y.clone()  # on the calling stream, right after the call
        y.backward(dy)
        dx_now = x.grad.clone()
        want_x = x_new.clone().requires_grad_(True)
        want = reference(want_x)
        want.backward(dy)
        torch.cuda.synchronize(device)
        assert bitwise_equal(y_now, want.detach()), f"step {i}: output"
        assert bitwise_equal(dx_now, want_x.grad), f"step {i}: input gradient"
        assert_same(sgd(reference), sgd(graphed), f"step {i} parameter gradients")


@needs_cuda
def test_event_lets_the_calling_stream_go_on_before_the_graph_ends():
    device = cuda_device()
    if "external" not in inspect.signature(torch.cuda.Event).parameters:
        pytest.skip("this torch has no torch.cuda.Event(external=True) to record inside a graph")
    reference = build("linear", device)
    x, _ = data(device, 1)[0]
    with torch.no_grad():
        want = reference(x)
    side = torch.cuda.Stream(device=device)
    for with_event in (False, True):
        event = torch.cuda.Event(external=True)
        graphed = _SleepThenLinear(device, event)
        make_graphed_callables(graphed, (static_sample(device, requires_grad=False),),
                               num_warmup_iters=1)  # fmt: skip
        torch.cuda.synchronize(device)
        with torch.no_grad():
            y = graphed(x, cuda_graph_stream=side, cuda_graph_event=event if with_event else None)
            y_now = y.clone()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the calling stream is through: has the graph ended?
        graph_ended = side.query()
        torch.cuda.synchronize(device)
        assert bitwise_equal(y_now, want)
        assert graph_ended is not with_event  # with the event: the trailing sleep still runs


class _EventThenSleepLinear(torch.nn.Module):
    """A te.Linear behind an event the graph records first and a long GPU sleep: the calling
    stream goes on at once, while the graph has yet to read its static input."""

    def __init__(self, device, event: torch.cuda.Event) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.linear = te.Linear(H, H, params_dtype=DTYPE, device=device)
        self.event = event

    def forward(self, x):
        self.event.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        return self.linear(x)


@needs_cuda
@pytest.mark.parametrize("why_eager", ["non_contiguous", "no_copy_nodes"])
def test_an_eagerly_copied_input_waits_for_the_previous_replay(why_eager, monkeypatch):
    """An input the next call copies eagerly (a non-contiguous one; every one without copy
    nodes) is written into the static input on the side stream, after the previous replay,
    which may still be ahead of reading it when the calling stream has gone on at its event."""
    device = cuda_device()
    if "external" not in inspect.signature(torch.cuda.Event).parameters:
        pytest.skip("this torch has no torch.cuda.Event(external=True) to record inside a graph")
    if why_eager == "no_copy_nodes":
        monkeypatch.setenv("NVTE_GRAPH_COPY_NODES", "0")  # read at the capture
    reference = build("linear", device)
    event = torch.cuda.Event(external=True)
    graphed = _EventThenSleepLinear(device, event)
    make_graphed_callables(graphed, (static_sample(device, requires_grad=False),),
                           num_warmup_iters=1)  # fmt: skip
    side = torch.cuda.Stream(device=device)
    (x1, _), (x2, _) = data(device, 2)
    inputs = (
        [x.t().contiguous().t() for x in (x1, x2)] if why_eager == "non_contiguous" else [x1, x2]
    )
    torch.cuda.synchronize(device)
    with torch.no_grad():
        y1 = graphed(inputs[0], cuda_graph_stream=side, cuda_graph_event=event)
        with torch.cuda.stream(side):
            y1_kept = y1.clone()  # after the first replay, before the second call's copy
        y2 = graphed(inputs[1], cuda_graph_stream=side, cuda_graph_event=event)
        torch.cuda.synchronize(device)
        want1, want2 = reference(x1), reference(x2)
    assert bitwise_equal(y1_kept, want1), "the first replay read the second call's input"
    assert bitwise_equal(y2, want2)


@needs_cuda
def test_the_calling_stream_itself_and_eager_runs_take_the_keywords():
    device, recipe = cuda_device(), make_recipe("delayed")
    eager, graphed = build("linear", device), build("linear", device)
    make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe)
    x, dy = data(device, 1)[0]
    here = torch.cuda.current_stream(device)
    assert_same(step(eager, x, dy, recipe), step(graphed, x, dy, recipe, cuda_graph_stream=here),
                "replay on the calling stream")  # fmt: skip
    assert_same(sgd(eager), sgd(graphed), "parameter gradients")
    graphed.eval()  # another training mode: eager, the keywords dropped
    eager.eval()
    with torch.no_grad(), te.autocast(recipe=recipe):
        y = graphed(x, cuda_graph_stream=torch.cuda.Stream(device=device))
        assert bitwise_equal(y, eager(x))


@needs_cuda
def test_schedule_functions_take_the_keywords():
    device = cuda_device()
    eager, layer = build("linear", device), build("linear", device)
    (graphed,) = make_graphed_callables((layer,), ((static_sample(device),),), _order=[1, -1])
    side = torch.cuda.Stream(device=device)
    for i, (x, dy) in enumerate(data(device, 3)):
        assert_same(step(eager, x, dy, None), step(graphed, x, dy, None, cuda_graph_stream=side),
                    f"step {i}")  # fmt: skip
        assert_same(sgd(eager), sgd(layer), f"step {i} parameter gradients")


@needs_cuda
def test_wrong_keywords_are_refused_before_the_replay():
    device = cuda_device()
    graphed = build("linear", device)
    make_graphed_callables(graphed, (static_sample(device),))
    x = torch.randn(TOKENS, H, device=device, dtype=DTYPE)
    with pytest.raises(TypeError, match="graphed Linear: cuda_graph_event must be"):
        graphed(x, cuda_graph_stream=torch.cuda.Stream(device=device), cuda_graph_event=1)
    with pytest.raises(TypeError, match="cuda_graph_stream must be a torch.cuda.Stream"):
        graphed(x, cuda_graph_stream=0)


@needs_two_gpus
def test_a_stream_of_another_device_is_refused():
    graphed = build("linear", torch.device("cuda", 1))
    make_graphed_callables(graphed, (static_sample(torch.device("cuda", 1)),))
    x = torch.randn(TOKENS, H, device="cuda:1", dtype=DTYPE)
    with pytest.raises(ValueError, match=r"cuda_graph_stream is on cuda:0, the graph on cuda:1"):
        graphed(x, cuda_graph_stream=torch.cuda.Stream(device=0))
    assert graphed(x, cuda_graph_stream=torch.cuda.Stream(device=1)).shape == (TOKENS, H)
