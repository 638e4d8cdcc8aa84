"""Edge cases of te.ops found by probing: zero-token inputs through the FP8 producer fusions,
a second backward through one forward (retain_graph=True), and similar corners.

The oracle is plain PyTorch in float64 (or the same operations built afresh), never the
operation under test against itself.
"""

import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import ops

STATELESS_RECIPES = {
    "bf16": None,
    "current": R.Float8CurrentScaling(),
    "block": R.Float8BlockScaling(),
}


def _autocast(recipe):
    return te.autocast(enabled=recipe is not None, recipe=recipe)


def _backward_twice(y, dy, x, module):
    """Two backwards through ``y`` (the first with ``retain_graph``): for each, the gradients of
    ``x`` and of ``module``'s parameters, which are reset in between."""
    grads = []
    for retain in (True, False):
        y.backward(dy, retain_graph=retain)
        grads.append([x.grad.clone()] + [p.grad.clone() for p in module.parameters()])
        x.grad = None
        for p in module.parameters():
            p.grad = None
    return grads


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling()], ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_zero_tokens_through_backward_activation_cast(recipe, bias, lead):
    """Linear, GELU, Linear with no rows: the backward fusion (BackwardActivationCast) reshaped
    the gradient with -1, which has no value for zero elements."""
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.Linear(128, 128, bias=bias, device="cpu"),
        ops.GELU(),
        ops.Linear(128, 128, bias=bias, device="cpu"),
    )
    x = torch.randn(*lead, 128, requires_grad=True)
    with _autocast(recipe):
        y = seq(x)
    assert y.shape == (*lead, 128)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for p in seq.parameters():
        assert p.grad is not None and p.grad.shape == p.shape
        assert torch.count_nonzero(p.grad) == 0


@pytest.mark.parametrize("name", list(STATELESS_RECIPES))
def test_grouped_linear_backward_twice(name):
    """A second backward through one GroupedLinear forward (retain_graph=True) gives the same
    gradients (the first one threw away the per-group saved state)."""
    recipe = STATELESS_RECIPES[name]
    torch.manual_seed(0)
    op = ops.GroupedLinear(3, 128, 128, device="cpu", dtype=torch.bfloat16)
    x = torch.randn(384, 128, dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([128, 0, 256])
    with _autocast(recipe):
        y = op(x, sizes)
    dy = torch.randn_like(y)
    grads = _backward_twice(y, dy, x, op)
    for first, second in zip(*grads):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
    if recipe is None:  # and against an independent computation
        ref = torch.cat(
            [
                F.linear(rows.double(), getattr(op, f"weight{i}").double())
                + getattr(op, f"bias{i}").double()
                for i, rows in enumerate(x.detach().split([128, 0, 256]))
            ]
        )
        torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_sequential_setitem_keeps_name_and_checks_type():
    """``seq[i] = module`` as in torch.nn.Sequential: the new module takes the replaced one's
    name (the state-dict keys of a Sequential built from a dict stay), and a non-module is a
    TypeError at once rather than "'int' object is not callable" at the next forward."""
    seq = ops.Sequential(
        {"norm": ops.LayerNorm(16, device="cpu"), "fc": ops.Linear(16, 16, device="cpu")}
    )
    x = torch.randn(4, 16)
    seq(x)  # the groups exist before the replacement
    fc = ops.Linear(16, 16, device="cpu")
    seq[-1] = fc
    assert list(seq._modules) == ["norm", "fc"] and seq.fc is fc
    assert "fc.basic_ops.0.weight" in seq.state_dict()
    y = seq(x)
    ref = F.linear(F.layer_norm(x, (16,), seq.norm.weight, seq.norm.bias), fc.weight, fc.bias)
    torch.testing.assert_close(y, ref)
    with pytest.raises(TypeError, match="torch.nn.Modules, got int"):
        seq[0] = 5
    assert list(seq) == [seq.norm, fc]


def _copy_of(seq, build):
    fresh = build()
    with torch.no_grad():
        for p, q in zip(seq.parameters(), fresh.parameters()):
            q.copy_(p)
    return fresh


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_fusion_plan_follows_backward_override(override):
    """Switching between Float8CurrentScaling(backward_override=...) and Float8CurrentScaling()
    (same recipe class) re-plans the fusions: the FP8 producer fusions, which apply only
    without backward_override, were missing (or kept) after the switch, so the Sequential gave
    other bits than a fresh one (BF16: the fusions round once)."""

    def build():
        torch.manual_seed(0)
        return ops.Sequential(
            ops.LayerNorm(64, device="cpu", dtype=torch.bfloat16),
            ops.Linear(64, 128, device="cpu", dtype=torch.bfloat16),
            ops.GELU(),
            ops.Linear(128, 64, device="cpu", dtype=torch.bfloat16),
        )

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    dy = torch.randn(32, 64, dtype=torch.bfloat16)

    def step(seq, recipe):
        for p in seq.parameters():
            p.grad = None
        inp = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y = seq(inp)
        y.backward(dy)
        return [y.detach(), inp.grad] + [p.grad for p in seq.parameters()]

    plain_recipe = R.Float8CurrentScaling()
    overridden = R.Float8CurrentScaling(backward_override=override)
    for first, second in ((overridden, plain_recipe), (plain_recipe, overridden)):
        seq = build()
        step(seq, first)
        fresh = _copy_of(seq, build)
        for got, want in zip(step(seq, second), step(fresh, second)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_missing_extra_input_names_the_operation():
    """A missing extra input names the operations that take them (the message was only
    "expected 1 extra inputs, got 0")."""
    seq = ops.Sequential(
        ops.LayerNorm(16, device="cpu"), ops.GroupedLinear(2, 16, 16, device="cpu")
    )
    with pytest.raises(ValueError, match=r"got 0: .*GroupedLinear \(1\).*split sizes"):
        seq(torch.randn(4, 16))
    with pytest.raises(ValueError, match="got 1: no operation takes any; pass the input alone"):
        ops.Linear(16, 16, device="cpu")(torch.randn(4, 16), torch.randn(16))


@pytest.mark.parametrize("in_place", [False, True])
def test_add_extra_input_shape_mismatch_names_both_shapes(in_place):
    """An extra input that does not broadcast with the input is a ValueError naming the
    operation and both shapes (it was torch's "The size of tensor a (4) must match ...")."""
    seq = ops.Sequential(ops.Linear(16, 16, device="cpu"), ops.AddExtraInput(in_place=in_place))
    with pytest.raises(ValueError, match=r"AddExtraInput: .* shape \(3, 16\).*\(4, 16\)"):
        seq(torch.randn(4, 16), torch.randn(3, 16))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_te_checkpoint_delayed_scaling_matches_plain_run(use_reentrant):
    """te.checkpoint around an ops.Sequential under DelayedScaling: the recompute (in the
    backward, after the autocast exit updated the scales) casts with the forward's scales, as
    the modules' recompute does, so every step is bitwise the run without checkpointing (the
    gradients were computed from activations quantized with the updated scales)."""

    def build():
        torch.manual_seed(0)
        return ops.Sequential(
            ops.LayerNorm(64, device="cpu"),
            ops.Linear(64, 128, device="cpu"),
            ops.GELU(),
            ops.Linear(128, 64, device="cpu"),
        )

    plain, checkpointed = build(), build()
    recipe = R.DelayedScaling()
    for step in range(3):
        torch.manual_seed(step + 1)
        x, dy = torch.randn(32, 64), torch.randn(32, 64)
        results = []
        for seq, ckpt in ((plain, False), (checkpointed, True)):
            for p in seq.parameters():
                p.grad = None
            inp = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                if ckpt:
                    y = te.checkpoint(seq, inp, use_reentrant=use_reentrant)
                else:
                    y = seq(inp)
            y.backward(dy)
            results.append([y.detach(), inp.grad] + [p.grad for p in seq.parameters()])
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for op in checkpointed.modules():
        assert not op.__dict__.get("_recompute_stash"), "a stash outlived its recompute"


def test_pickle_whole_sequential_after_delayed_scaling_forward():
    """torch.save of a whole ops.Sequential (not its state dict) after a DelayedScaling step:
    the operations held the process-wide amax registry, whose weak references cannot be
    pickled. The loaded copy trains on bitwise like the original."""
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.LayerNorm(64, device="cpu"),
        ops.Linear(64, 64, device="cpu"),
        ops.GELU(),
        ops.GroupedLinear(2, 64, 64, device="cpu"),
    )
    recipe = R.DelayedScaling()
    x, sizes, dy = torch.randn(32, 64), torch.tensor([16, 16]), torch.randn(32, 64)

    def step(model):
        for p in model.parameters():
            p.grad = None
        with te.autocast(recipe=recipe):
            y = model(x, sizes)
        y.backward(dy)
        return [y.detach()] + [p.grad for p in model.parameters()]

    step(seq)
    buf = io.BytesIO()
    torch.save(seq, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for _ in range(2):
        for got, want in zip(step(loaded), step(seq)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(STATELESS_RECIPES) + ["delayed"])
def test_backward_releases_saved_tensors_while_output_lives(name):
    """After a backward (without retain_graph) nothing keeps what the forward saved, though
    the output (a loss still bound in a training loop during the next forward) keeps the
    graph: the operations' contexts held the unpacked linear inputs and the refilled FP8
    storages as long as the graph lived. A second backward with retain_graph=True still
    gets the same gradients."""
    recipe = R.DelayedScaling() if name == "delayed" else STATELESS_RECIPES[name]
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.LayerNorm(128, device="cpu"),
        ops.Linear(128, 128, device="cpu"),
        ops.GELU(cache_quantized_input=True),
        ops.GroupedLinear(2, 128, 128, device="cpu"),
    )
    params = {id(p) for p in seq.parameters()}
    x = torch.randn(128, 128, requires_grad=True)
    sizes = torch.tensor([64, 64])
    saved = []

    def pack(t):
        if id(t) not in params and t is not x:
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(recipe):
        y = seq(x, sizes)
    assert saved
    dy = torch.randn_like(y)
    grads = _backward_twice(y, dy, x, seq)
    gc.collect()
    assert y.grad_fn is not None  # the graph is still there ...
    assert all(ref() is None for ref in saved)  # ... but what it saved is gone
    if name != "delayed":  # delayed scaling updated its scales after the first backward
        for first, second in zip(*grads):
            torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_grouped_linear_split_sizes_take_any_integers():
    """GroupedLinear's split sizes as NumPy integers or 0-d integer tensors (they were refused
    as "must be ints"); floats and bools are still refused, naming the fix."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    op = ops.GroupedLinear(2, 16, 16, device="cpu")
    x = torch.randn(8, 16)
    ref = torch.cat(
        [
            F.linear(x[:3], op.weight0, op.bias0),
            F.linear(x[3:], op.weight1, op.bias1),
        ]
    )
    for sizes in (np.array([3, 5]), [np.int32(3), np.int64(5)], [torch.tensor(3), 5]):
        torch.testing.assert_close(op(x, sizes), ref)
    for bad in ([3.0, 5.0], [True, 7]):
        with pytest.raises(ValueError, match="must be integers.*list of ints or an integer"):
            op(x, bad)


def test_leaving_delayed_scaling_after_the_registry_was_cleared():
    """An operation that registered under DelayedScaling, then runs under another recipe after
    the registry was cleared (or replaced by reset()), has nothing to retire there (it had
    raised KeyError for positions the cleared registry no longer holds); back under
    DelayedScaling it registers anew."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    def run(op, recipe):
        with te.autocast(recipe=recipe):
            op(torch.randn(32, 64, requires_grad=True)).sum().backward()

    FP8GlobalStateManager.reset()
    op = ops.BasicLinear(64, 64, device="cpu")
    run(op, R.DelayedScaling())
    registry = FP8GlobalStateManager.quantization_state.amax_registry
    registry.clear()
    run(op, R.Float8CurrentScaling())
    assert len(registry) == 0
    run(op, R.DelayedScaling())
    assert len(registry) == 2
    FP8GlobalStateManager.reset()
    run(op, R.Float8CurrentScaling())
    run(op, R.DelayedScaling())
    assert len(FP8GlobalStateManager.quantization_state.amax_registry) == 2
    FP8GlobalStateManager.reset()


def test_shallow_copy_shares_recipe_state():
    """copy.copy of an operation shares its recipe state and registration (only pickles and
    deep copies leave the amax registry out), so the same scales are never registered twice."""
    op = ops.BasicLinear(64, 64, device="cpu")
    with te.autocast(recipe=R.DelayedScaling()):
        op(torch.randn(32, 64, requires_grad=True)).sum().backward()
    shallow, deep = copy.copy(op), copy.deepcopy(op)
    assert shallow._fp8_metas is op._fp8_metas and shallow.weight is op.weight
    assert deep.recipe_state("forward").scale is not op.recipe_state("forward").scale
    assert "_registry" in op._fp8_metas["forward"]
    assert "_registry" not in deep._fp8_metas["forward"]
