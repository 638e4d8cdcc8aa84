"""``make_graphed_callables(cache_quantized_params=True)``: one graph per callable serves both
values of ``is_first_microbatch``, against the same modules run eagerly.

Each step runs three microbatches, the first with ``is_first_microbatch=True`` (the weights are
cast into the cache) and the others with ``False`` (the cache is read): outputs, input
gradients, the weight gradients (``main_grad`` with ``fuse_wgrad_accumulation``, which a first
microbatch overwrites and the others add to) and the FP8 state must be bit for bit eager's. An
SGD update between steps moves the weights, so a first-microbatch replay that did not cast them
again, or a later one that did, would show.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import DTYPE, TOKENS, H, assert_same, cuda_device, fp8_state, sgd
from utils import make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

MICROBATCHES = 3


def build(kind: str, fuse: bool) -> torch.nn.Module:
    torch.manual_seed(1234)
    kw = dict(params_dtype=DTYPE, device=cuda_device(), fuse_wgrad_accumulation=fuse)
    module = te.Linear(H, H, **kw) if kind == "linear" else te.LayerNormMLP(H, 2 * H, **kw)
    if fuse:  # values a first microbatch must overwrite, not add to
        for p in module.parameters():
            p.main_grad = torch.full(p.shape, 7.0, device=cuda_device(), dtype=torch.float32)
    return module


def microbatches(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(TOKENS, H, generator=g).to(cuda_device(), DTYPE) for _ in range(2))
        for _ in range(MICROBATCHES)
    ]


def run_step(model, batches, recipe) -> list:
    results = []
    for m, (x, dy) in enumerate(batches):
        x = x.clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe):
            y = model(x, is_first_microbatch=m == 0)
        y.backward(dy)
        results += [y.detach().clone(), x.grad.clone()]
    return results


@needs_cuda
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_one_graph_follows_is_first_microbatch(recipe_name, kind, fuse):
    recipe = make_recipe(recipe_name)
    eager, graphed = build(kind, fuse), build(kind, fuse)
    sample = (torch.randn(TOKENS, H, device=cuda_device(), dtype=DTYPE, requires_grad=True),)
    # with fuse_wgrad_accumulation the weights' gradients go to main_grad, not to autograd
    make_graphed_callables(graphed, sample, enabled=True, recipe=recipe,
                           cache_quantized_params=True, allow_unused_input=fuse)  # fmt: skip
    owner = graphed.reset.__self__
    assert owner.captured.is_first_microbatch is False  # the one graph, captured as a later one
    for s in range(3):
        batches = microbatches(seed=s)
        assert_same(run_step(eager, batches, recipe), run_step(graphed, batches, recipe), f"{s}")
        assert_same(sgd(eager), sgd(graphed), f"step {s} weight gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {s} FP8 state")
    # the graph's own flag, and upstream's process-wide one its replays set too
    flag = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor(cuda_device())
    assert flag is not owner.captured.skip_flag
    assert flag.item() == owner.captured.skip_flag.item() == 1.0  # the last call reused them


@needs_cuda
def test_the_graph_keeps_its_flag_across_a_state_reset():
    """``FP8GlobalStateManager.reset()`` drops the per-device flag; the graph reads its own,
    which the replays still set (and the new global one with it)."""
    recipe = make_recipe("delayed")
    eager, graphed = build("linear", False), build("linear", False)
    sample = (torch.randn(TOKENS, H, device=cuda_device(), dtype=DTYPE, requires_grad=True),)
    make_graphed_callables(graphed, sample, enabled=True, recipe=recipe,
                           cache_quantized_params=True)  # fmt: skip
    for s in range(4):
        if s == 2:
            FP8GlobalStateManager.reset()
        batches = microbatches(seed=10 + s)
        assert_same(run_step(eager, batches, recipe), run_step(graphed, batches, recipe), f"{s}")
        assert_same(sgd(eager), sgd(graphed), f"step {s} weight gradients")
    flag = FP8GlobalStateManager.get_skip_fp8_weight_update_tensor(cuda_device())
    assert flag is not None and flag.item() == 1.0


def _private_pools() -> dict:
    """Bytes reserved per private (graph) memory pool, by pool id: every segment outside the
    default pool (0, 0)."""
    pools: dict = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(segment["segment_pool_id"])
        if pool != (0, 0):
            pools[pool] = pools.get(pool, 0) + segment["total_size"]
    return pools


@needs_cuda
def test_caching_holds_no_second_set_of_activations():
    """A pipeline schedule (``_order``, two microbatches in flight): the capture's memory pool
    with weight caching stays near the pool without it. (Two graphs per callable, one per value
    of ``is_first_microbatch``, had to keep both graphs' activations alive at once.) Measured as
    the capture's own pool: what the eager warm-up leaves in the default pool (the weight cache,
    and more or less of the rest depending on what the process ran before) is not the graphs'."""
    tokens, hidden = 2048, 1024

    def pool_bytes(caching: bool) -> int:
        torch.manual_seed(1234)
        layer = te.LayerNormMLP(hidden, 4 * hidden, params_dtype=DTYPE, device=cuda_device())
        samples = tuple(
            (torch.randn(tokens, hidden, device=cuda_device(), dtype=DTYPE, requires_grad=True),)
            for _ in range(2)
        )
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = _private_pools()
        graphs = make_graphed_callables(layer, samples, _order=[1, 1, -1, -1], enabled=True,
                                        recipe=make_recipe("delayed"),
                                        cache_quantized_params=caching)  # fmt: skip
        captured = sum(v for k, v in _private_pools().items() if k not in before)
        for g in graphs:
            g.reset()
        return captured

    plain, cached = pool_bytes(False), pool_bytes(True)
    assert cached < 1.3 * plain, f"with caching {cached} bytes, without {plain}"


@needs_cuda
def test_a_first_microbatch_without_backward_leaves_main_grad():
    """Only a replay whose backward will run zeroes ``main_grad`` for a first microbatch: a
    no-grad call with ``is_first_microbatch=True`` between two microbatches leaves the first
    one's weight gradient in place, as the eager module does."""
    recipe = make_recipe("delayed")
    eager, graphed = build("linear", True), build("linear", True)
    sample = (torch.randn(TOKENS, H, device=cuda_device(), dtype=DTYPE, requires_grad=True),)
    make_graphed_callables(graphed, sample, enabled=True, recipe=recipe,
                           cache_quantized_params=True, allow_unused_input=True)  # fmt: skip
    (x0, dy0), (x1, dy1), (x2, _) = microbatches(seed=20)
    for model in (eager, graphed):
        run_step(model, [(x0, dy0)], recipe)
        with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
            model(x2, is_first_microbatch=True)
        x = x1.clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe):
            model(x, is_first_microbatch=False).backward(dy1)
    assert_same(sgd(eager), sgd(graphed), "weight gradients of both microbatches")


class EventThenSleep(torch.nn.Module):
    """A ``te.Linear`` whose graph records ``event`` first and then sleeps before the layer: a
    caller that waits for the event goes on while the weight cast is still to come."""

    def __init__(self, event: torch.cuda.Event) -> None:
        super().__init__()
        self.event = event
        self.linear = build("linear", False)

    def forward(self, x, is_first_microbatch=None):
        self.event.record()
        torch.cuda._sleep(50_000_000)  # about 25 ms
        return self.linear(x, is_first_microbatch=is_first_microbatch)


@needs_cuda
def test_a_side_stream_replay_casts_under_its_own_flag_while_the_caller_runs_ahead():
    """``cuda_graph_stream`` with ``cuda_graph_event``: the calling stream waits only for the
    event, so the next call's ``is_first_microbatch=False`` is set while the first replay's
    weight cast is still queued. The weights moved since capture, so a first replay whose cast
    read that ``False`` would leave stale weights in the cache for both microbatches."""
    recipe = make_recipe("delayed")
    event = torch.cuda.Event(external=True)
    eager, graphed = build("linear", False), EventThenSleep(event)
    sample = (torch.randn(TOKENS, H, device=cuda_device(), dtype=DTYPE),)
    make_graphed_callables(graphed, sample, enabled=True, recipe=recipe,
                           cache_quantized_params=True)  # fmt: skip
    with torch.no_grad():
        for m in (eager, graphed.linear):
            m.weight.mul_(-0.5)  # the cache the capture left is stale now
    (x1, _), (x2, _) = microbatches(seed=3)[:2]
    side = torch.cuda.Stream()
    with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
        graphed(x1, is_first_microbatch=True, cuda_graph_stream=side, cuda_graph_event=event)
        y = graphed(x2, is_first_microbatch=False, cuda_graph_stream=side, cuda_graph_event=event)
        torch.cuda.current_stream().wait_stream(side)
        eager(x1, is_first_microbatch=True)
        expected = eager(x2, is_first_microbatch=False)
    assert_same([expected], [y], "second microbatch")
