"""Activation CPU offload (``te.get_cpu_offload_context``): arguments, layer bookkeeping, which
tensors leave, and gradients against the same model run without offload.

The bookkeeping runs on the CPU too: the ``offload_on_cpu`` fixture lets CPU tensors be
offloaded (each copy out and back is then a plain host copy), so what is saved, copied, dropped
and rebuilt is checked without a GPU. The GPU tests check the memory given back during the
forward, bitwise gradients with the real side-stream copies, and a layer on ``cuda:1``.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from utils import bitwise_equal, make_recipe, needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.pytorch import _offload_copies, cpu_offload
from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context


@pytest.fixture
def offload_on_cpu(monkeypatch):
    """CPU tensors are offloaded too, whatever their size."""
    monkeypatch.setattr(_offload_copies, "OFFLOAD_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(_offload_copies, "MIN_OFFLOAD_BYTES", 1)


@pytest.fixture
def spy(monkeypatch):
    """Counts of the copies out and back, and which get() found its copy back already started."""
    counts = {"out": 0, "back": 0, "prefetched": 0, "got": 0}
    cls = _offload_copies.OffloadedTensor
    start_offload, start_reload, get = cls.start_offload, cls.start_reload, cls.get

    def spied_offload(self, *args, **kwargs):
        counts["out"] += not self.offload_started
        return start_offload(self, *args, **kwargs)

    def spied_reload(self, *args, **kwargs):
        before = self._reloaded
        start_reload(self, *args, **kwargs)
        counts["back"] += before is None and self._reloaded is not None

    def spied_get(self, *args, **kwargs):
        counts["got"] += 1
        back = self._back() if self._back is not None else None
        # Already on its way back, or back and in use (a tensor saved twice): not copied now.
        counts["prefetched"] += self._reloaded is not None or back is not None
        return get(self, *args, **kwargs)

    monkeypatch.setattr(cls, "start_offload", spied_offload)
    monkeypatch.setattr(cls, "start_reload", spied_reload)
    monkeypatch.setattr(cls, "get", spied_get)
    return counts


def make_layers(kind: str, count: int, device, hidden=32):
    torch.manual_seed(1234)
    if kind == "linear":
        return [te.Linear(hidden, hidden, device=device) for _ in range(count)]
    if kind == "mlp":
        return [te.LayerNormMLP(hidden, 2 * hidden, device=device) for _ in range(count)]
    return [
        te.TransformerLayer(
            hidden, 2 * hidden, 2, hidden_dropout=0.0, attention_dropout=0.0, device=device
        )
        for _ in range(count)
    ]


def forward_stack(layers, x, recipe=None, offload=None):
    """``(input leaf, output)`` of the stack's forward (``x`` is the leaf when it requires
    grad, else a copy is); ``offload``: ``(context, sync_function)`` or None."""
    if not x.requires_grad:
        x = x.detach().clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = x
        for layer in layers:
            if offload is None:
                y = layer(y)
            else:
                context, sync = offload[:2]
                with context:
                    y = layer(y)
                y = sync(y)
    return x, y


def backward_stack(layers, x, y):
    """``(output, [input gradient, parameter gradients...])``; the parameters' are cleared."""
    y.float().square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def run_step(layers, x, recipe=None, offload=None):
    """Forward + backward of the stack: ``(output, gradients)``."""
    return backward_stack(layers, *forward_stack(layers, x, recipe, offload))


def assert_same(a, b):
    (ya, ga), (yb, gb) = a, b
    assert bitwise_equal(ya, yb)
    assert len(ga) == len(gb)
    for u, v in zip(ga, gb):
        assert bitwise_equal(u, v)


# --- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "transformer_engine.pytorch.get_cpu_offload_context",
        "transformer_engine.pytorch.mark_not_offload",
        "transformer_engine.pytorch.ManualOffloadSynchronizer",
        "transformer_engine.pytorch.cpu_offload.get_cpu_offload_context",
        "transformer_engine.pytorch.cpu_offload.mark_not_offload",
        "transformer_engine.pytorch.cpu_offload.start_offload",
        "transformer_engine.pytorch.cpu_offload.is_cpu_offload_enabled",
        "transformer_engine.pytorch.cpu_offload.DefaultOffloadSynchronizer",
        "transformer_engine.pytorch.cpu_offload.OffloadableLayerState",
    ],
)
def test_upstream_import_paths(path):
    module, name = path.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))


def test_disabled_returns_null_context_and_identity():
    context, sync = get_cpu_offload_context(False)
    x = torch.ones(3)
    with context:
        assert not cpu_offload.is_cpu_offload_enabled()
    assert sync(x) is x
    context, sync, controller = get_cpu_offload_context(False, manual_synchronization=True)
    assert controller is None and sync(x) is x


def test_argument_errors():
    with pytest.raises(ValueError, match="nothing to offload"):
        get_cpu_offload_context(True, 1, 4, offload_activations=False)
    with pytest.raises(ValueError, match="at most 3 layers"):
        get_cpu_offload_context(True, 4, 4)
    with pytest.raises(ValueError, match="manual_synchronization=True only"):
        get_cpu_offload_context(True, 1, 4, offload_stream=object())
    with pytest.warns(UserWarning, match="every layer but the last"):
        get_cpu_offload_context(True, 3, 4)
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        get_cpu_offload_context(True, 1, 4, offload_weights=True)
    with pytest.raises(ValueError, match="model_layers"):
        get_cpu_offload_context(True, 0, 0)
    # Manual synchronization may offload every layer; the 7th positional is manual.
    out = get_cpu_offload_context(True, 4, 4, True, False, False, True)
    assert len(out) == 3 and isinstance(out[2], te.ManualOffloadSynchronizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_cpu_offload_context(True, 2, 4, double_buffering=True)  # accepted, ignored


def test_context_needs_sync_between_layers():
    context, sync = get_cpu_offload_context(True, 1, 3)
    x = torch.ones(2, requires_grad=True)
    with context:
        assert cpu_offload.is_cpu_offload_enabled()
        y = x * 2
    assert not cpu_offload.is_cpu_offload_enabled()
    with pytest.raises(RuntimeError, match="sync_function"):
        with context:
            pass
    y = sync(y)
    with context:  # after the sync the next layer may enter
        y = y * 2
    y = sync(y)
    with pytest.raises(TypeError, match="output tensor"):
        sync((y,))


def test_layer_that_raised_can_run_again():
    context, sync = get_cpu_offload_context(True, 1, 3)
    with pytest.raises(ZeroDivisionError):
        with context:
            1 / 0  # noqa: B018
    with context:  # no RuntimeError: the failed layer was forgotten
        y = torch.ones(2, requires_grad=True) * 2
    sync(y)


def test_forward_without_grad_needs_no_sync(offload_on_cpu, spy):
    """Evaluation loops call the sync function only when grad is enabled (Megatron's does)."""
    layers = make_layers("linear", 3, "cpu")
    x = torch.randn(8, 2, 32)
    context, sync = get_cpu_offload_context(True, 1, 3)
    with torch.no_grad():
        y = x
        for layer in layers:
            with context:
                y = layer(y)
    assert spy["out"] == 0
    reference = run_step(make_layers("linear", 3, "cpu"), x)
    assert_same(run_step(layers, x, None, (context, sync)), reference)
    assert spy["out"] > 0 and spy["back"] == spy["out"]


def test_sync_output_takes_inplace_ops():
    context, sync = get_cpu_offload_context(True, 1, 3)
    x = torch.ones(4, requires_grad=True)
    with context:
        y = x * 3
    y = sync(y)
    y += 1  # not a view of the function's input: autograd allows it
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0))


# --- the bookkeeping, on the CPU -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "mlp", "transformer"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_gradients_bitwise_equal_without_offload(offload_on_cpu, spy, kind, recipe):
    x = torch.randn(8, 2, 32)
    # Two steps each (the layer count wraps at model_layers; delayed scaling's state moves on).
    plain = make_layers(kind, 4, "cpu")
    references = [run_step(plain, x, make_recipe(recipe)) for _ in range(2)]
    layers = make_layers(kind, 4, "cpu")
    offload = get_cpu_offload_context(True, num_layers=2, model_layers=4)
    for reference in references:
        counts_before = dict(spy)
        assert_same(run_step(layers, x, make_recipe(recipe), offload), reference)
        out = spy["out"] - counts_before["out"]
        assert out > 0
        assert spy["back"] - counts_before["back"] == out  # every copy came back
        # Each copy back was started by the sync calls' backward before autograd asked for it.
        assert spy["prefetched"] - counts_before["prefetched"] == spy["got"] - counts_before["got"]


@pytest.mark.filterwarnings("ignore:CPU offload of")
def test_copies_back_start_one_layer_ahead(offload_on_cpu, monkeypatch):
    """Layer k's copies back are queued before layer k+1's backward reads its first saved
    tensor, so they overlap that backward."""
    layers = make_layers("mlp", 4, "cpu")
    events, layer_of = [], {}
    state_cls, handle_cls = cpu_offload.OffloadableLayerState, _offload_copies.OffloadedTensor
    add, start_reload, get = state_cls.add, state_cls.start_reload, handle_cls.get

    def spied_add(self, tensor):
        handle = add(self, tensor)
        layer_of[id(handle)] = self.index
        return handle

    def spied_reload(self, streams):
        events.append(("reload", self.index))
        start_reload(self, streams)

    def spied_get(self, streams):
        events.append(("get", layer_of[id(self)]))
        return get(self, streams)

    monkeypatch.setattr(state_cls, "add", spied_add)
    monkeypatch.setattr(state_cls, "start_reload", spied_reload)
    monkeypatch.setattr(handle_cls, "get", spied_get)
    run_step(layers, torch.randn(8, 2, 32), None, get_cpu_offload_context(True, 3, 4))
    first_get = {}
    for position, (kind, index) in enumerate(events):
        if kind == "get":
            first_get.setdefault(index, position)
    assert sorted(first_get) == [0, 1, 2]
    for index in (0, 1):
        reload_at = events.index(("reload", index))
        assert reload_at < first_get[index + 1], events


def test_only_the_first_layers_are_offloaded(offload_on_cpu, monkeypatch):
    layers = make_layers("linear", 4, "cpu")
    per_layer = []
    original = cpu_offload.OffloadableLayerState.add

    def add(self, tensor):
        per_layer.append(self.index)
        return original(self, tensor)

    monkeypatch.setattr(cpu_offload.OffloadableLayerState, "add", add)
    run_step(layers, torch.randn(8, 2, 32), None, get_cpu_offload_context(True, 1, 4))
    assert per_layer and set(per_layer) == {0}


def test_parameters_and_marked_tensors_stay(offload_on_cpu):
    saved = {}

    class SaveBoth(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, keep):
            ctx.save_for_backward(x, w, keep)
            return x * w * keep

        @staticmethod
        def backward(ctx, grad):
            saved["tensors"] = ctx.saved_tensors
            x, w, keep = ctx.saved_tensors
            return grad * w * keep, grad * x * keep, None

    w = torch.nn.Parameter(torch.randn(8))
    keep = torch.randn(8)
    te.mark_not_offload(keep)
    x = torch.randn(8, requires_grad=True)
    context, sync = get_cpu_offload_context(True, 1, 3)
    with context:
        y = SaveBoth.apply(x, w, keep)
    y = sync(y)
    y.sum().backward()
    x_back, w_back, keep_back = saved["tensors"]
    # Kept (the same memory), not copies; x went to host memory and came back.
    assert w_back.data_ptr() == w.data_ptr() and keep_back.data_ptr() == keep.data_ptr()
    assert x_back.data_ptr() != x.data_ptr() and torch.equal(x_back, x)
    assert torch.equal(x.grad, w.detach() * keep)


def test_mark_not_offload_tags_a_quantized_tensors_buffers(offload_on_cpu):
    quantizer = te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3, device="cpu")
    weight = quantizer(torch.randn(32, 32))
    storage = quantizer.copy()
    storage.internal = True
    storage = storage(torch.randn(32, 32))
    plain = torch.randn(32, 32)
    assert _offload_copies.offload_candidate(weight._data)
    te.mark_not_offload(weight, storage, None, plain)
    for buffer in (weight._data, weight._scale_inv, storage._data, plain, plain[1:]):
        assert not _offload_copies.offload_candidate(buffer)


def test_start_offload_shares_one_copy_with_views(offload_on_cpu, spy):
    base = torch.randn(4, 6, requires_grad=True)
    context, sync = get_cpu_offload_context(True, 1, 3)
    with context:
        qkv = base * 1.0
        cpu_offload.start_offload(qkv.view(4, 3, 2)[:, 0], offload_base_tensor=True)
        q, k = qkv.view(4, 3, 2)[:, 0], qkv.view(4, 3, 2)[:, 1]
        y = q * k  # saves both views of qkv
    y = sync(y)
    y.sum().backward()
    assert spy["out"] == 1  # one copy of the base, not one per view
    q_ref, k_ref = base.detach().view(4, 3, 2)[:, 0], base.detach().view(4, 3, 2)[:, 1]
    expected = torch.zeros(4, 3, 2)
    expected[:, 0], expected[:, 1] = k_ref, q_ref
    assert torch.equal(base.grad, expected.view(4, 6))


def manual_forward(layers, x, context, sync, controller, offloaded: int):
    """The stack's forward under manual synchronization: each of the first ``offloaded``
    layers is copied out and released right after its sync call. ``(input leaf, output)``."""
    x_in = x.clone().requires_grad_()
    y = x_in
    for index, layer in enumerate(layers):
        with context:
            y = layer(y)
        y = sync(y)
        if index < offloaded:
            controller.start_offload_layer(index)
            controller.release_activation_forward_gpu_memory(index)
    return x_in, y


def test_manual_synchronization(offload_on_cpu, spy):
    layers = make_layers("linear", 3, "cpu")
    x = torch.randn(8, 2, 32)
    reference = run_step(layers, x)
    context, sync, controller = get_cpu_offload_context(True, 3, 3, manual_synchronization=True)
    # Layers 0 and 1 go to host memory; layer 2 is recorded but stays.
    x_in, y = manual_forward(layers, x, context, sync, controller, offloaded=2)
    assert spy["out"] > 0 and spy["back"] == 0  # nothing happens on its own
    controller.start_reload_layer(1)
    assert_same(backward_stack(layers, x_in, y), reference)
    assert spy["back"] == spy["out"]  # layer 0 came back on demand
    with pytest.raises(IndexError):
        controller.start_reload_layer(3)


def test_retained_host_buffers_are_reused(offload_on_cpu, monkeypatch):
    layers = make_layers("linear", 3, "cpu")
    hosts = []
    original = _offload_copies.OffloadedTensor.start_offload

    def start_offload(self, streams, host=None):
        original(self, streams, host)
        hosts.append(self.host.data_ptr())

    monkeypatch.setattr(_offload_copies.OffloadedTensor, "start_offload", start_offload)
    offload = get_cpu_offload_context(True, 1, 3, retain_pinned_cpu_buffers=True)
    x = torch.randn(8, 2, 32)
    run_step(layers, x, None, offload)
    first = list(hosts)
    hosts.clear()
    run_step(layers, x, None, offload)
    assert first and hosts == first


def test_second_backward_with_retained_graph(offload_on_cpu):
    context, sync = get_cpu_offload_context(True, 1, 3)
    x = torch.randn(8, requires_grad=True)
    with context:
        y = (x * x).sin()
    y = sync(y)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.equal(x.grad, first)
    assert torch.equal(first, torch.cos(x.detach() * x.detach()) * 2 * x.detach())


# --- on a GPU --------------------------------------------------------------------------------


def _gpu_step_memory(layers, x, recipe, offload):
    """Bytes allocated on ``x``'s device after the forward (before backward), and the step."""
    device = x.device
    x = x.detach().clone().requires_grad_()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    x, y = forward_stack(layers, x, recipe, offload)
    torch.cuda.synchronize(device)
    # Memory freed while a side stream still used it is returned at the allocator's next
    # allocation (it checks the streams' events then): one tiny allocation settles it.
    torch.empty(1, device=device)
    held = torch.cuda.memory_allocated(device) - before
    return held, backward_stack(layers, x, y)


@needs_cuda
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_gpu_offload_frees_memory_and_keeps_gradients(recipe):
    device = torch.device("cuda", torch.cuda.current_device())

    def build():
        torch.manual_seed(0)
        return [
            te.LayerNormMLP(1024, 4096, device=device, params_dtype=torch.bfloat16)
            for _ in range(4)
        ]

    x = torch.randn(2048, 1024, device=device, dtype=torch.bfloat16)
    # Two steps each, on equal stacks (delayed scaling's state moves on from step to step).
    plain = build()
    references = [_gpu_step_memory(plain, x, make_recipe(recipe), None) for _ in range(2)]
    layers = build()
    offload = get_cpu_offload_context(True, num_layers=3, model_layers=4)
    for held_plain, reference in references:
        held, result = _gpu_step_memory(layers, x, make_recipe(recipe), offload)
        assert_same(result, reference)
        # Three of four layers' saved activations left the GPU.
        assert held < 0.5 * held_plain, (held, held_plain)


@needs_cuda
def test_gpu_host_copies_are_pinned_and_retained():
    device = torch.device("cuda", torch.cuda.current_device())
    layers = make_layers("linear", 3, device, hidden=512)
    x = torch.randn(1024, 512, device=device)
    reference = run_step(layers, x)
    context, sync = get_cpu_offload_context(True, 2, 3, retain_pinned_cpu_buffers=True)
    for _ in range(2):
        assert_same(run_step(layers, x, None, (context, sync)), reference)
    pool = context.synchronizer._pool
    buffers = [b for layer in pool._buffers.values() for b in layer]
    assert buffers and all(b.is_pinned() for b in buffers)


@needs_cuda
def test_gpu_manual_synchronization_on_a_given_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    layers = make_layers("mlp", 3, device, hidden=256)
    x = torch.randn(512, 256, device=device)
    reference = run_step(layers, x)
    stream = torch.cuda.Stream(device=device)
    context, sync, controller = get_cpu_offload_context(
        True, 2, 3, manual_synchronization=True, offload_stream=stream
    )
    x_in, y = manual_forward(layers, x, context, sync, controller, offloaded=2)
    controller.start_reload_layer(1)
    controller.start_reload_layer(0)
    assert_same(backward_stack(layers, x_in, y), reference)


@needs_two_gpus
def test_gpu_layers_on_another_device_than_the_current():
    device = torch.device("cuda", 1)
    layers = make_layers("mlp", 3, device, hidden=256)
    x = torch.randn(512, 256, device=device)
    with torch.cuda.device(1):
        reference = run_step(layers, x)
    torch.cuda.set_device(0)
    memory_on_0 = torch.cuda.memory_allocated(0)
    result = run_step(layers, x, None, get_cpu_offload_context(True, 2, 3))
    assert_same(result, reference)
    assert torch.cuda.memory_allocated(0) == memory_on_0  # nothing landed on the current device
