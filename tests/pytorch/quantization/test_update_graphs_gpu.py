"""The delayed-scaling update replayed from a CUDA graph (quantization/update_graph.py).

Oracle: the reference update (float32 on the CPU) applied to copies of the same pairs, step by
step; and a te.Linear trained with the updates as native calls (the graphs switched off).
Skipped without CUDA (reason given); the two-GPU test needs two GPUs in one process.
"""

import gc

import pytest
import torch
from utils import needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
from transformer_engine.pytorch import reference
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, update_graph
from transformer_engine.pytorch.quantization.amax_registry import AmaxRegistry
from transformer_engine.pytorch.quantization.update_graph import UpdateGraph

pytestmark = needs_cuda

KEY = "k"


def make_pair(device, slots, length=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    history = (torch.rand(length, slots, generator=g) * 100).to(device)
    return history, torch.ones(slots, device=device)


class Mirror:
    """CPU copies of registered pairs, updated by the reference at every step."""

    def __init__(self):
        self.live, self.copies = [], []

    def add(self, history, scale):
        self.live.append((history, scale))
        self.copies.append((history.cpu(), scale.cpu()))

    def new_amaxes(self, step):
        """Write a fresh row 0 into every pair (as the quantizers do in a forward)."""
        for i, ((h, _), (hc, _)) in enumerate(zip(self.live, self.copies)):
            row = torch.arange(h.shape[1], dtype=torch.float32) * (step + 1) + 0.5 * i + 1.0
            h[0].copy_(row.to(h.device))
            hc[0].copy_(row)

    def update(self, recipe):
        reference.delayed_scaling_update(
            [h for h, _ in self.copies], [s for _, s in self.copies],
            torch.float8_e4m3fn, recipe.margin, recipe.amax_compute_algo,
        )  # fmt: skip

    def assert_equal(self):
        torch.cuda.synchronize()
        for (h, s), (hc, sc) in zip(self.live, self.copies):
            assert torch.equal(h.cpu(), hc) and torch.equal(s.cpu(), sc)


def graph_of(registry, device):
    return registry._update_graphs.get(KEY, {}).get(torch.device(device))


def step(registry, mirror, recipe, i):
    mirror.new_amaxes(i)
    registry.reduce_and_update(KEY, recipe, forward=True)
    mirror.update(recipe)
    mirror.assert_equal()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_replays_match_the_reference_and_follow_group_changes(algo):
    recipe = DelayedScaling(fp8_format=Format.E4M3, margin=1, amax_compute_algo=algo)
    registry, mirror = AmaxRegistry(), Mirror()
    for slots, seed in ((3, 0), (70, 1)):  # 70 slots: the kernel for wide pairs
        pair = make_pair("cuda:0", slots, seed=seed)
        registry.register(KEY, *pair)
        mirror.add(*pair)
    step(registry, mirror, recipe, 0)
    assert graph_of(registry, "cuda:0") is not None and not isinstance(
        graph_of(registry, "cuda:0"), UpdateGraph
    )  # the first update is a native call
    for i in range(1, 4):
        step(registry, mirror, recipe, i)
    first = graph_of(registry, "cuda:0")
    assert isinstance(first, UpdateGraph)
    step(registry, mirror, recipe, 4)
    assert graph_of(registry, "cuda:0") is first  # replayed, not captured again

    extra = make_pair("cuda:0", 2, seed=2)  # a new pair: the group and its graph are rebuilt
    registry.register(KEY, *extra)
    mirror.add(*extra)
    assert graph_of(registry, "cuda:0") is None
    for i in range(5, 8):
        step(registry, mirror, recipe, i)

    recipe.margin = 3  # a recipe changed in place: captured again with the new margin
    step(registry, mirror, recipe, 8)
    assert graph_of(registry, "cuda:0").config[1] == 3


def test_a_freed_pair_drops_the_graph_and_is_not_updated():
    recipe = DelayedScaling(fp8_format=Format.E4M3)
    registry, mirror = AmaxRegistry(), Mirror()
    kept = make_pair("cuda:0", 3, seed=0)
    registry.register(KEY, *kept)
    mirror.add(*kept)
    dropped = make_pair("cuda:0", 5, seed=1)
    registry.register(KEY, *dropped)
    for i in range(3):
        dropped[0][0].fill_(1.0)
        step(registry, mirror, recipe, i)
    assert isinstance(graph_of(registry, "cuda:0"), UpdateGraph)
    del dropped
    gc.collect()
    assert graph_of(registry, "cuda:0") is None
    for i in range(3, 6):
        step(registry, mirror, recipe, i)


def replaying_one_pair(device, slots, steps):
    """A registry holding one pair on ``device``, updated ``steps`` times (each checked against
    the reference): by then its update replays a graph. Returns ``(recipe, registry, mirror)``."""
    recipe = DelayedScaling(fp8_format=Format.E4M3)
    registry, mirror = AmaxRegistry(), Mirror()
    pair = make_pair(device, slots)
    registry.register(KEY, *pair)
    mirror.add(*pair)
    for i in range(steps):
        step(registry, mirror, recipe, i)
    assert isinstance(graph_of(registry, device), UpdateGraph)
    return recipe, registry, mirror


def test_inside_a_users_capture_the_update_is_recorded_not_replayed():
    recipe, registry, mirror = replaying_one_pair("cuda:0", 4, steps=3)
    user = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        user.capture_begin()
        registry.reduce_and_update(KEY, recipe, forward=True)
        user.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    mirror.assert_equal()  # capturing ran nothing
    for i in range(3, 6):
        mirror.new_amaxes(i)
        user.replay()
        mirror.update(recipe)
        mirror.assert_equal()


def train(graphs, monkeypatch, steps=6):
    monkeypatch.setattr(update_graph, "GRAPH_SCALE_UPDATES", graphs)
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    layer = te.Linear(128, 64, device="cuda", params_dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=4)
    outs = []
    for i in range(steps):
        x = (torch.randn(32, 128, device="cuda") * (i + 1)).bfloat16().requires_grad_()
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
        outs += [y.detach(), x.grad, layer.weight.grad.clone()]
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    replayed = any(
        isinstance(g, UpdateGraph) for per in registry._update_graphs.values() for g in per.values()
    )
    states = [layer.fp8_meta[k].amax_history.clone() for k in ("scaling_fwd", "scaling_bwd")]
    states += [layer.fp8_meta[k].scale.clone() for k in ("scaling_fwd", "scaling_bwd")]
    FP8GlobalStateManager.reset()
    return outs + states, replayed


def test_a_training_run_is_bitwise_the_run_with_native_updates(monkeypatch):
    with_graphs, replayed = train(True, monkeypatch)
    without, replayed_without = train(False, monkeypatch)
    assert replayed and not replayed_without
    for a, b in zip(with_graphs, without):
        assert torch.equal(a, b)


@needs_two_gpus
def test_a_group_on_cuda1_replays_there_while_cuda0_is_current():
    torch.cuda.set_device(0)
    replaying_one_pair("cuda:1", 6, steps=4)
    assert torch.cuda.current_device() == 0


def test_a_capture_leaves_a_running_replays_random_draws_alone():
    """Capturing an update refills the default generator's graph-safe seed and offset (torch
    does so at every capture): a graph still running on the current stream, replayed before,
    must draw its dropout mask from the offset its replay set, not from the refilled one. The
    graph sleeps before its dropout so that the capture is made while it runs."""
    x = torch.ones(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.nn.functional.dropout(x, 0.5)  # warm-up before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(100_000_000)  # about 50 ms
        out = torch.nn.functional.dropout(x, 0.5)
    history, scale = make_pair("cuda", 2)

    def replay(capture_meanwhile: bool) -> torch.Tensor:
        torch.manual_seed(3)
        torch.rand(8, device="cuda")  # the replay's offset is not the one a capture writes
        graph.replay()
        if capture_meanwhile:
            UpdateGraph(torch.device("cuda"), [history], [scale], torch.float8_e4m3fn, 0, "max")
        torch.cuda.synchronize()
        return out.clone()

    alone = replay(False)
    assert torch.equal(replay(False), alone)  # the oracle is itself reproducible
    assert torch.equal(replay(True), alone)
