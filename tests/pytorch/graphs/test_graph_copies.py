"""The copies a graphed callable makes into and out of its static tensors, as nodes of the graph.

Oracle: the same model run eagerly (bit for bit), and, for the parameter gradients a replay
hands out, their own values cloned at the time: a later replay must not change them. Each case
runs with the copies in the graph (the default) and issued eagerly (``NVTE_GRAPH_COPY_NODES=0``),
including the replays the graph cannot copy for (an input that is the static tensor itself, a
non-contiguous input or output gradient), and the native entry points' refusals.
"""

from __future__ import annotations

import pytest
import torch
from utils import bitwise_equal, make_recipe, needs_cuda

import transformer_engine.pytorch as te
from transformer_engine.common.native import native_module
from transformer_engine.pytorch import _graph_copies
from transformer_engine.pytorch._graph_copies import GraphCopies, _Slot, copy_nodes_enabled
from transformer_engine.pytorch.graph import make_graphed_callables

H, TOKENS = 128, 64
DTYPE = torch.bfloat16


def test_copy_nodes_follow_the_environment(monkeypatch):
    monkeypatch.setenv("NVTE_GRAPH_COPY_NODES", "0")
    assert not copy_nodes_enabled()
    monkeypatch.delenv("NVTE_GRAPH_COPY_NODES")
    expected = native_module() is not None and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")
    assert copy_nodes_enabled() == expected


class FakeNative:
    """Stands in for the native entry points: records the executable-graph updates, and
    raises on a retarget once told to (as a driver refusing the update would)."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls, self.refuse = [], refuse

    def graph_exec_retarget_copy(self, exec_, node, dst, src, nbytes, device):
        if self.refuse:
            raise RuntimeError("nvte_graph_exec_retarget_copy: refused")
        self.calls.append(("retarget", node, dst, src, nbytes))

    def graph_exec_enable_copy(self, exec_, node, enabled, device):
        self.calls.append(("enable" if enabled else "disable", node))


def finished_copies(monkeypatch, fake, *statics) -> GraphCopies:
    """A GraphCopies as finish() leaves it (nodes found, all disabled), over CPU tensors."""
    monkeypatch.setattr(_graph_copies, "native_module", lambda: fake)
    copies = GraphCopies(torch.device("cuda", 0), True)
    for k, t in enumerate(statics):
        copies.slots.append(_Slot(t))
        copies.slots[-1].node = 100 + k
    copies.exec = 1
    return copies


def test_replay_copy_protocol(monkeypatch):
    """Which node updates each replay makes: retarget (+ enable once), disable when the input
    is the static tensor or is copied eagerly (non-contiguous), and a fresh tensor out."""
    fake = FakeNative()
    static = torch.zeros(4, 6)
    copies = finished_copies(monkeypatch, fake, static)
    x = torch.randn(4, 6)
    copies.copy_in(0, x)
    copies.copy_in(0, x)
    assert fake.calls == [
        ("retarget", 100, static.data_ptr(), x.data_ptr(), 96),
        ("enable", 100),
        ("retarget", 100, static.data_ptr(), x.data_ptr(), 96),
    ]
    assert torch.equal(static, torch.zeros(4, 6)), "the graph copies, not the host"
    fake.calls.clear()
    copies.copy_in(0, static)  # nothing to copy: the node is disabled
    strided = torch.randn(6, 4).t()
    copies.copy_in(0, strided)  # copied now; the node stays disabled
    assert fake.calls == [("disable", 100)]
    assert torch.equal(static, strided)
    fake.calls.clear()
    out = copies.copy_out(0)
    assert out.shape == static.shape and out.data_ptr() != static.data_ptr()
    assert fake.calls == [("retarget", 100, out.data_ptr(), static.data_ptr(), 96), ("enable", 100)]


def test_a_refused_update_falls_back_to_eager_copies(monkeypatch):
    fake = FakeNative()
    static, grad = torch.zeros(3, 5), torch.zeros(5)
    copies = finished_copies(monkeypatch, fake, static, grad)
    monkeypatch.setattr(_graph_copies, "_warned", False)
    copies.copy_in(0, torch.ones(3, 5))  # node 100 enabled, pointing at that tensor
    fake.refuse = True
    x = torch.randn(3, 5)
    with pytest.warns(RuntimeWarning, match="run eagerly .*refused.*NVTE_GRAPH_COPY_NODES=0"):
        copies.copy_in(0, x)
    assert torch.equal(static, x), "copied eagerly instead"
    assert fake.calls[-1] == ("disable", 100), "the stale node must not copy again"
    assert not copies.usable
    fake.refuse = False
    fake.calls.clear()
    y = torch.randn(3, 5)
    copies.copy_in(0, y)  # no further attempt, no second warning
    assert fake.calls == [] and torch.equal(static, y)
    assert copies.copy_out(1) is None, "the caller clones after the replay instead"


def build(device) -> torch.nn.Module:
    torch.manual_seed(7)
    return te.Linear(H, H, params_dtype=DTYPE, device=device)


def run(model, x, dy, recipe) -> list:
    """Output, input gradient and parameter gradients of one step (the gradients as handed
    out, not cloned); the parameters' .grad are cleared first."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def graphed_pair(device, recipe, monkeypatch, nodes: bool):
    monkeypatch.setenv("NVTE_GRAPH_COPY_NODES", "1" if nodes else "0")
    eager, graphed = build(device), build(device)
    sample = torch.randn(TOKENS, H, device=device, dtype=DTYPE, requires_grad=True)
    make_graphed_callables(graphed, (sample,), enabled=recipe is not None, recipe=recipe)
    monkeypatch.delenv("NVTE_GRAPH_COPY_NODES")
    return eager, graphed, sample


def inputs(device, kind: str, sample: torch.Tensor, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(TOKENS, H, generator=g).to(device, DTYPE)
    dy = torch.randn(TOKENS, H, generator=g).to(device, DTYPE)
    if kind == "strided":  # same shapes, transposed storage: copied eagerly
        x, dy = x.t().contiguous().t(), dy.t().contiguous().t()
        assert not x.is_contiguous() and not dy.is_contiguous()
    elif kind == "static":  # the capture's own sample as the input: nothing to copy
        with torch.no_grad():
            sample.copy_(x)
        x = sample
    return x, dy


@needs_cuda
@pytest.mark.parametrize("nodes", [True, False], ids=["in_graph", "eager_copies"])
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed", "current"])
def test_graphed_steps_match_eager_and_keep_earlier_gradients(recipe_name, nodes, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = make_recipe(recipe_name)
    eager, graphed, sample = graphed_pair(device, recipe, monkeypatch, nodes)
    kept = []  # every step's handed-out gradients, and their values at the time
    for step, kind in enumerate(["plain", "strided", "plain", "static", "plain", "strided"]):
        x, dy = inputs(device, kind, sample, seed=step)
        want = run(eager, x.clone(), dy.clone(), recipe)
        got = run(graphed, x, dy, recipe)
        for i, (a, b) in enumerate(zip(want, got)):
            assert bitwise_equal(a, b), f"step {step} ({kind}): result {i} differs from eager"
        params = got[2:]
        kept.append((params, [g.clone() for g in params]))
        for earlier, (grads, values) in enumerate(kept):
            for g, v in zip(grads, values):
                assert bitwise_equal(g, v), f"step {step} changed step {earlier}'s gradients"
        with torch.no_grad():  # the weights move, identically
            for p, q in zip(eager.parameters(), graphed.parameters()):
                p.sub_(0.25 * p.grad)
                q.sub_(0.25 * q.grad)


@needs_cuda
def test_the_graph_copies_unless_disabled(monkeypatch):
    """The copies recorded in the graphs: the input (forward); the output gradient and the
    weight's and bias's gradients (backward); none with NVTE_GRAPH_COPY_NODES=0."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not copy_nodes_enabled():
        pytest.skip("copy nodes unavailable here (native library or torch's keep_graph)")
    for nodes, counts in ((True, (1, 3)), (False, (0, 0))):
        _, graphed, _ = graphed_pair(device, None, monkeypatch, nodes)
        cells = graphed.forward.__closure__  # the installed replay closes over its owner
        owner = next(c.cell_contents for c in cells if hasattr(c.cell_contents, "captured"))
        v = owner.captured
        assert (len(v.fwd_copies.slots), len(v.bwd_copies.slots)) == counts


@needs_cuda
def test_native_graph_copy_refusals():
    native = native_module()
    if native is None:
        pytest.skip("native library not built")
    device = torch.cuda.current_device()
    t = torch.zeros(16, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream
    with pytest.raises(ValueError, match="not capturing"):
        native.graph_copy(t.data_ptr(), t.data_ptr(), 64, device, stream)
    with pytest.raises(ValueError, match="bytes > 0"):
        native.graph_copy(t.data_ptr(), t.data_ptr(), 0, device, stream)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    u = torch.zeros_like(t)
    with torch.cuda.graph(graph):
        native.graph_copy(u.data_ptr(), u.data_ptr(), 64, device, graph_stream())
        u.add_(1)
    raw = graph.raw_cuda_graph()
    with pytest.raises(RuntimeError, match="holds 0 memcpy nodes"):
        native.graph_find_copy(raw, t.data_ptr(), u.data_ptr(), 64, device)
    node = native.graph_find_copy(raw, u.data_ptr(), u.data_ptr(), 64, device)
    graph.instantiate()
    exec_ = graph.raw_cuda_graph_exec()
    with pytest.raises(ValueError, match="distinct"):
        native.graph_exec_retarget_copy(exec_, node, u.data_ptr(), u.data_ptr(), 64, device)
    t.fill_(5)
    native.graph_exec_retarget_copy(exec_, node, u.data_ptr(), t.data_ptr(), 64, device)
    graph.replay()
    assert torch.equal(u, torch.full_like(u, 6))  # copied 5s, then added 1
    native.graph_exec_enable_copy(exec_, node, False, device)
    graph.replay()
    assert torch.equal(u, torch.full_like(u, 7))  # no copy: added 1 to the 6s


def graph_stream() -> int:
    return torch.cuda.current_stream().cuda_stream
