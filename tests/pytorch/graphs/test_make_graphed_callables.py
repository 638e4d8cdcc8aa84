"""``te.make_graphed_callables``: graphed modules against the same modules run eagerly.

The oracle is the eager path: two copies of a model built from the same seed, one graphed, run
the same 10 training steps (forward inside ``te.autocast``, backward, an SGD update so the
weights move), and every step's output, input gradient, parameter gradients and FP8 state
(scales and amax histories of both directions) must be bit for bit the same. The CPU part checks
the argument rules and errors, which are raised before anything touches a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from graph_helpers import DTYPE, TOKENS, H, assert_same, fp8_state, sgd
from utils import bitwise_equal, current_device_unchanged, make_recipe, needs_cuda, needs_two_gpus

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.graph import is_graph_capturing, make_graphed_callables
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

STEPS = 10


# -- CPU: argument rules and errors -----------------------------------------------------------
def cpu_linear() -> te.Linear:
    return te.Linear(32, 32, device="cpu")


def sample() -> tuple:
    return (torch.randn(16, 32),)


def test_only_modules_can_be_graphed():
    with pytest.raises(TypeError, match="only torch.nn.Module callables"):
        make_graphed_callables(lambda x: x, sample())
    with pytest.raises(TypeError, match="callable 1 is a function"):
        make_graphed_callables((cpu_linear(), lambda x: x), (sample(), sample()))


def test_mixed_training_modes_are_refused():
    with pytest.raises(RuntimeError, match="different training modes"):
        make_graphed_callables((cpu_linear(), cpu_linear().eval()), (sample(), sample()))


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward", "nested"])
def test_hooks_registered_at_call_time_are_refused(kind):
    module = torch.nn.Sequential(cpu_linear())
    target = module[0] if kind == "nested" else module
    if kind == "forward_pre":
        target.register_forward_pre_hook(lambda m, a: None)
    elif kind == "full_backward":
        target.register_full_backward_hook(lambda m, gi, go: None)
    else:
        target.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(RuntimeError, match="module hooks registered on"):
        make_graphed_callables(module, sample())


def test_capture_time_hooks_need_known_kinds():
    with pytest.raises(ValueError, match="capture_time_hooks\\[0\\] must be a dict"):
        make_graphed_callables(cpu_linear(), sample(), capture_time_hooks=({"after": {}},))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(_num_layers_per_chunk=[1]), ValueError, "need _order"),
        (dict(_reuse_graph_input_output_buffers=True), ValueError, "need _order"),
        (dict(num_warmup_iters=0), ValueError, "num_warmup_iters=0 must be an int >= 1"),
        (dict(num_warmup_iters=True), ValueError, "num_warmup_iters=True"),
        (dict(enabled=(True, False)), ValueError, "one bool per callable"),
        (dict(fp8_enabled=True, enabled=True), ValueError, "same argument"),
        (dict(fp8_weight_caching=True, cache_quantized_params=False), ValueError, "same"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_graphed_callables(cpu_linear(), sample(), **kwargs)


@pytest.mark.parametrize(
    "old, new", [("fp8_enabled", "enabled"), ("fp8_calibrating", "calibrating")]
)
def test_old_names_warn_then_behave_as_the_new(old, new):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; use {new}"):
        with pytest.raises(ValueError, match="CUDA graphs need CUDA tensors"):
            make_graphed_callables(cpu_linear(), sample(), **{old: True})


def test_sample_args_must_be_tuples_of_tensors():
    with pytest.raises(TypeError, match="must be a tuple of tensors"):
        make_graphed_callables(cpu_linear(), torch.randn(16, 32))
    with pytest.raises(TypeError, match="holds a int at position 1"):
        make_graphed_callables(cpu_linear(), (torch.randn(16, 32), 3))
    with pytest.raises(ValueError, match="1 sample_args for 2 callables"):
        make_graphed_callables((cpu_linear(), cpu_linear()), (sample(),))


def test_cpu_module_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="parameter 'weight' is on cpu; CUDA graphs need CUDA"):
        make_graphed_callables(cpu_linear(), sample())


def test_buffer_requiring_grad_is_refused():
    module = cpu_linear()
    module.register_buffer("running", torch.zeros(3, requires_grad=True))
    with pytest.raises(ValueError, match="buffer 'running' of callable 0 requires grad"):
        make_graphed_callables(module, sample())


def test_weight_caching_needs_a_callable_that_takes_is_first_microbatch():
    container = torch.nn.Sequential(cpu_linear())
    with pytest.raises(ValueError, match="Sequential.forward .* takes none"):
        make_graphed_callables(container, sample(), cache_quantized_params=True)


def test_a_module_with_its_own_forward_attribute_is_refused():
    module = cpu_linear()
    module.forward = lambda x: x
    with pytest.raises(ValueError, match="already graphed"):
        make_graphed_callables(module, sample())


def test_not_capturing_outside_make_graphed_callables():
    assert is_graph_capturing() is False


# -- GPU: graphed == eager --------------------------------------------------------------------
def build(kind: str, device) -> torch.nn.Module:
    torch.manual_seed(1234)
    kw = dict(params_dtype=DTYPE, device=device)
    if kind == "linear":
        return te.Linear(H, H, **kw)
    if kind == "layernorm_linear":
        return te.LayerNormLinear(H, H, **kw)
    if kind == "layernorm_mlp":
        return te.LayerNormMLP(H, 4 * H, **kw)
    # a TransformerLayer-sized stack: projection, output projection, MLP
    return torch.nn.Sequential(
        te.LayerNormLinear(H, H, **kw), te.Linear(H, H, **kw), te.LayerNormMLP(H, 2 * H, **kw)
    )


def data(device, steps=STEPS, seed=0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(TOKENS, H, generator=g).to(device, DTYPE),
         torch.randn(TOKENS, H, generator=g).to(device, DTYPE))
        for _ in range(steps)
    ]  # fmt: skip


def static_sample(device, requires_grad=True) -> torch.Tensor:
    return torch.randn(TOKENS, H, device=device, dtype=DTYPE, requires_grad=requires_grad)


def step(model, x, dy, recipe, **kwargs) -> list:
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x, **kwargs)
    y.backward(dy)
    return [y.detach().clone(), x.grad.clone()]


def run_and_compare(eager, graphed, recipe, device, steps=STEPS) -> None:
    for i, (x, dy) in enumerate(data(device, steps)):
        assert_same(step(eager, x, dy, recipe), step(graphed, x, dy, recipe), f"step {i}")
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")


@needs_cuda
@pytest.mark.parametrize("recipe_name", ["high_precision", "delayed", "current"])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp", "stack"])
def test_graphed_module_matches_eager(kind, recipe_name):
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = make_recipe(recipe_name)
    eager, graphed = build(kind, device), build(kind, device)
    result = make_graphed_callables(
        graphed, (static_sample(device),), enabled=recipe is not None, recipe=recipe
    )
    assert result is graphed and "forward" in graphed.__dict__
    assert type(graphed).__call__ is torch.nn.Module.__call__  # no class patched
    assert fp8_state(graphed) == [] or all(
        bitwise_equal(t, torch.ones_like(t) if t.dim() == 1 else torch.zeros_like(t))
        for t in fp8_state(graphed)
    ), "warm-up changed the FP8 state"
    run_and_compare(eager, graphed, recipe, device)


@needs_cuda
def test_graphed_delayed_scaling_survives_a_registry_reset():
    """After FP8GlobalStateManager.reset() both register anew (the graphed one at its next
    replay's end) and keep updating alike."""
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = make_recipe("delayed")
    eager, graphed = build("linear", device), build("linear", device)
    make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe)
    run_and_compare(eager, graphed, recipe, device, steps=3)
    FP8GlobalStateManager.reset()
    run_and_compare(eager, graphed, recipe, device, steps=4)
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 4


@needs_cuda
def test_per_layer_graphs_with_per_callable_enabled():
    """BF16 edges, FP8 middle: enabled=(False, True, False), one graph per layer."""
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = DelayedScaling()
    eager, graphed = build("stack", device), build("stack", device)
    make_graphed_callables(
        tuple(graphed),
        tuple((static_sample(device),) for _ in range(3)),
        enabled=(False, True, False),
        recipe=recipe,
    )

    def eager_forward(x):
        with te.autocast(enabled=False):
            h = eager[0](x)
        h = eager[1](h)
        with te.autocast(enabled=False):
            return eager[2](h)

    for i, (x, dy) in enumerate(data(device)):
        results = []
        for forward in (eager_forward, graphed):
            xi = x.clone().requires_grad_(True)
            with te.autocast(recipe=recipe):
                y = forward(xi)
            y.backward(dy)
            results.append([y.detach().clone(), xi.grad.clone()])
        assert_same(*results, f"step {i}")
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")
        assert_same(fp8_state(eager), fp8_state(graphed), f"step {i} FP8 state")
    # the BF16 edges never made FP8 state, graphed or not
    assert fp8_state(graphed[0]) == fp8_state(graphed[2]) == fp8_state(eager[0]) == []


@needs_cuda
@pytest.mark.parametrize("old_name", [False, True])
def test_cached_weights_follow_is_first_microbatch(old_name):
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = DelayedScaling()
    eager, graphed = build("linear", device), build("linear", device)
    caching = {"fp8_weight_caching" if old_name else "cache_quantized_params": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe,
                               **caching)  # fmt: skip
    x, dy = data(device, 1)[0]
    with pytest.raises(ValueError, match="needs is_first_microbatch=True or False"):
        step(graphed, x, dy, recipe)
    with pytest.raises(ValueError, match="call it with is_first_microbatch=True first"):
        step(graphed, x, dy, recipe, is_first_microbatch=False)
    batches = data(device, 6, seed=1)
    for s in range(2):
        for mb in range(3):
            x, dy = batches[3 * s + mb]
            first = mb == 0
            assert_same(
                step(eager, x, dy, recipe, is_first_microbatch=first),
                step(graphed, x, dy, recipe, is_first_microbatch=first),
                f"step {s} microbatch {mb}",
            )
            assert_same(fp8_state(eager), fp8_state(graphed), f"step {s}.{mb} FP8 state")
        assert_same(sgd(eager), sgd(graphed), f"step {s} parameter gradients")
    flag = te.FP8GlobalStateManager.get_skip_fp8_weight_update_tensor(device)
    assert flag is not None and flag.item() == 1.0  # the last call reused the weights


@needs_cuda
def test_replay_only_in_the_captured_training_mode():
    device = torch.device("cuda", torch.cuda.current_device())
    reference = build("linear", device)
    torch.manual_seed(1234)
    graphed = torch.nn.Sequential(te.Linear(H, H, params_dtype=DTYPE, device=device),
                                  torch.nn.Dropout(0.5))  # fmt: skip
    make_graphed_callables(graphed, (static_sample(device),))
    graphed.eval()  # eager now: no dropout, the plain linear layer
    x = data(device, 1)[0][0]
    with torch.no_grad():
        assert bitwise_equal(graphed(x), reference(x))
    graphed.train()  # the graph again: dropout zeroes about half of the outputs
    zeros = (graphed(x) == 0).float().mean().item()
    assert 0.3 < zeros < 0.7


@needs_cuda
def test_warm_up_leaves_the_dropout_rng_unchanged():
    device = torch.device("cuda", torch.cuda.current_device())

    def model():
        torch.manual_seed(1234)
        return torch.nn.Sequential(te.Linear(H, H, params_dtype=DTYPE, device=device),
                                   torch.nn.Dropout(0.5))  # fmt: skip

    eager, graphed = model(), model()
    sample_x = static_sample(device)
    torch.manual_seed(7)
    make_graphed_callables(graphed, (sample_x,), num_warmup_iters=2)
    graphed_steps = [step(graphed, x, dy, None) for x, dy in data(device, 3)]
    torch.manual_seed(7)
    eager_steps = [step(eager, x, dy, None) for x, dy in data(device, 3)]
    for i, (a, b) in enumerate(zip(eager_steps, graphed_steps)):
        assert_same(a, b, f"step {i}")


@needs_two_gpus
def test_capture_on_cuda1_while_cuda0_is_current():
    device = torch.device("cuda", 1)
    recipe = DelayedScaling()
    with torch.cuda.device(0), current_device_unchanged():
        eager, graphed = build("stack", device), build("stack", device)
        make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe)
        run_and_compare(eager, graphed, recipe, device)


@needs_cuda
def test_reset_returns_to_eager():
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = DelayedScaling()
    eager, graphed = build("layernorm_mlp", device), build("layernorm_mlp", device)
    make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe)
    run_and_compare(eager, graphed, recipe, device, steps=3)
    graphed.reset()
    assert "forward" not in graphed.__dict__ and "reset" not in graphed.__dict__
    run_and_compare(eager, graphed, recipe, device, steps=3)


@needs_cuda
def test_capture_survives_garbage_graphs_of_earlier_calls():
    """A graphed module that was dropped is a reference cycle holding CUDA graphs; a garbage
    collection inside a later capture would destroy them mid-capture (illegal: it invalidates
    the capture). With the collector triggered by every allocation, capturing still works and
    leaves the collector as it found it."""
    import gc

    device = torch.device("cuda", torch.cuda.current_device())
    for kind in ("layernorm_mlp", "linear"):
        make_graphed_callables(build(kind, device), (static_sample(device),))  # dropped
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        eager, graphed = build("stack", device), build("stack", device)
        make_graphed_callables(graphed, (static_sample(device),))
        assert gc.isenabled()
    finally:
        gc.set_threshold(*threshold)
    run_and_compare(eager, graphed, None, device, steps=3)


@needs_cuda
def test_deferred_weight_gradients_replay_through_backward_dw():
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = DelayedScaling()

    def model():
        torch.manual_seed(1234)
        return te.Linear(H, H, params_dtype=DTYPE, device=device, delay_wgrad_compute=True)

    eager, graphed = model(), model()
    make_graphed_callables(graphed, (static_sample(device),), enabled=True, recipe=recipe,
                           allow_unused_input=True)  # fmt: skip
    for i, (x, dy) in enumerate(data(device, 4)):
        assert_same(step(eager, x, dy, recipe), step(graphed, x, dy, recipe), f"step {i}")
        assert eager.weight.grad is None and graphed.weight.grad is None
        eager.backward_dw()
        graphed.backward_dw()
        assert_same(sgd(eager), sgd(graphed), f"step {i} parameter gradients")


@needs_cuda
def test_hooks_and_capture_flag():
    device = torch.device("cuda", torch.cuda.current_device())
    calls = []
    seen = lambda kind: lambda m: calls.append((kind, is_graph_capturing()))  # noqa: E731
    hooks = {kind: {0: seen(kind)} for kind in ("forward_pre_hooks", "backward_hooks")}
    make_graphed_callables(
        build("linear", device), (static_sample(device),), num_warmup_iters=2,
        pre_warmup_hook=lambda: calls.append(("pre", is_graph_capturing())),
        post_warmup_hook=lambda: calls.append(("post", is_graph_capturing())),
        capture_time_hooks=(hooks,),
    )  # fmt: skip
    kinds = [k for k, _ in calls]
    assert kinds == ["pre"] + ["forward_pre_hooks", "backward_hooks"] * 2 + ["post"] + [
        "forward_pre_hooks",
        "backward_hooks",
    ]
    assert all(capturing for _, capturing in calls) and not is_graph_capturing()


@needs_cuda
def test_replay_checks_its_inputs():
    device = torch.device("cuda", torch.cuda.current_device())
    graphed = make_graphed_callables(build("linear", device), (static_sample(device, False),))
    with pytest.raises(ValueError, match="input 0 is torch.bfloat16 \\(32, 128\\)"):
        graphed(torch.zeros(32, H, device=device, dtype=DTYPE))
    with pytest.raises(ValueError, match="input 0 is torch.float32"):
        graphed(torch.zeros(TOKENS, H, device=device))
    with pytest.raises(TypeError, match="positional and keyword arguments"):
        graphed(static_sample(device, False), is_first_microbatch=True)
    with pytest.raises(ValueError, match="input 0 requires grad but its sample argument did not"):
        graphed(static_sample(device, True))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="cache_enabled=False"):
            make_graphed_callables(build("linear", device), (static_sample(device),))
