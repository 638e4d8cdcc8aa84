"""te.ops.GroupedLinear.

On CPU: forward and backward against per-group F.linear in float64 (high precision tight;
DelayedScaling and Float8CurrentScaling within tests/pytorch/tolerances.py, and tight against
the dequantized operands each group's own quantizers produced), the per-group quantizer slots,
empty groups, split-size errors, Sequential, and deferred initialization on meta (first
forward, optimizer, reset_parameters, FP8 weights); on two GPUs, meta initialization on cuda:1
while cuda:0 is current.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import (
    FP8_RECIPES,
    autocast_by_name,
    current_scale,
    fake_quant,
    materialization_device,
    needs_two_gpus,
)

import transformer_engine.pytorch as te
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops.fuser import OperationFuser
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
G, IN, OUT = 4, 64, 48
SPLITS = [32, 0, 48, 16]  # group 1 is empty
# Row counts that are not multiples of 16 (in FP8 the weight-gradient GEMMs reduce over them).
ODD_SPLITS = [10, 0, 23, 7]


def build(num_groups=G, in_features=IN, out_features=OUT, seed=0, **kwargs):
    """Weights ~ N(0, 1/in_features), biases ~ N(0, 0.04) (nonzero, so they are checked)."""
    op = ops.GroupedLinear(num_groups, in_features, out_features, device="cpu", **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in op.parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise / math.sqrt(in_features) if p.dim() == 2 else 0.2 * noise)
    return op


def reference_run(op, x, dy, splits):
    """float64 per-group F.linear: output, input gradient, parameter gradients by name."""
    params = {n: p.detach().double().requires_grad_() for n, p in op.named_parameters()}
    x = x.detach().double().requires_grad_()
    rows = x.reshape(-1, op.in_features)
    y = torch.cat(
        [
            F.linear(group, params[f"weight{i}"], params.get(f"bias{i}"))
            for i, group in enumerate(rows.split(splits))
        ]
    ).reshape(*x.shape[:-1], op.out_features)
    y.backward(dy.double())
    return y, x.grad, {n: p.grad for n, p in params.items()}


def hp_key(dtype):
    # BF16 outputs of BF16 values against float64 of the same values
    return ("same_values", dtype)


# ------------------------------------------------------------------------------------------
# GroupedLinear numerics


@pytest.mark.parametrize("sizes", [SPLITS, ODD_SPLITS], ids=["aligned", "odd"])
@pytest.mark.parametrize("splits_as", ["tensor", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_grouped_linear_matches_per_group_linear(recipe, dtype, splits_as, sizes):
    op = build(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    rows = sum(sizes)
    x = torch.randn(rows, IN, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(rows, OUT, generator=g).to(dtype)
    splits = torch.tensor(sizes) if splits_as == "tensor" else sizes
    with autocast_by_name(recipe):
        y = op(x, splits)
    y.backward(dy)
    y_ref, dx_ref, grads_ref = reference_run(op, x, dy, sizes)
    assert y.shape == (rows, OUT) and y.dtype == dtype and x.grad.dtype == dtype
    for name, p in op.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype and p.grad.shape == p.shape, name
    assert torch.equal(op.weight1.grad, torch.zeros_like(op.weight1))  # the empty group
    assert torch.equal(op.bias1.grad, torch.zeros_like(op.bias1))
    if recipe is None:
        assert op.recipe_state("forward") is None
        assert_close_by_table(y, y_ref, hp_key(dtype))
        assert_close_by_table(x.grad, dx_ref, hp_key(dtype))
        for name, p in op.named_parameters():
            assert_close_by_table(p.grad, grads_ref[name], hp_key(dtype))
        return
    assert_close_by_table(y, y_ref, ("e4m3", dtype))
    assert_close_by_table(x.grad, dx_ref, ("hybrid", dtype))
    for name, p in op.named_parameters():
        key = ("same_values", dtype) if name.startswith("bias") else ("hybrid", dtype)
        assert_close_by_table(p.grad, grads_ref[name], key)
    # Tight, against the dequantized operands of each group's own quantizers.
    x_rows = x.detach().split(sizes)
    dy_rows = dy.split(sizes)
    dx_rows = x.grad.split(sizes)
    y_rows = y.detach().split(sizes)
    for i, m in enumerate(sizes):
        if m == 0:
            continue
        w, b = op.get_parameter(f"weight{i}"), op.get_parameter(f"bias{i}")
        if recipe == "delayed":
            sx = sw = sdy = torch.ones(1)  # first step: scales are still 1
        else:
            sx = current_scale(x_rows[i], E4M3)
            sw = current_scale(w, E4M3)
            sdy = current_scale(dy_rows[i], E5M2)
        xq, wq = fake_quant(x_rows[i], sx, E4M3), fake_quant(w, sw, E4M3)
        dyq = fake_quant(dy_rows[i], sdy, E5M2)
        key = ("fp8_dequantized", dtype)
        assert_close_by_table(y_rows[i], xq @ wq.t() + b.detach().double(), key)
        assert_close_by_table(dx_rows[i], dyq @ wq, key)
        assert_close_by_table(w.grad, dyq.t() @ xq, key)


def test_grouped_linear_per_group_quantizer_slots_and_one_backward_update():
    """Forward slots 2i (input) / 2i+1 (weight), backward slot i (grad output); the backward
    scales are updated once, after every group's grad output was quantized."""
    op = build()
    assert op.num_quantizers("forward") == 2 * G and op.num_quantizers("backward") == G
    assert op.get_input_quantizer() is None and op.get_grad_output_quantizer() is None
    x = torch.randn(sum(SPLITS), IN, requires_grad=True)
    with autocast_by_name("delayed"):
        y = op(x, SPLITS)
        fwd, bwd = op.recipe_state("forward"), op.recipe_state("backward")
        amaxes = fwd.amax_history[0].clone()  # before the update at the autocast exit
    assert fwd.num_quantizers == 2 * G and bwd.num_quantizers == G
    assert all(q is not None for q in op._quantizers["forward"] + op._quantizers["backward"])
    used = {2 * i + 1 for i in range(G)} | {2 * i for i, m in enumerate(SPLITS) if m}
    for slot in range(2 * G):  # the empty group's weight is quantized, its input not
        assert (amaxes[slot] > 0) == (slot in used), (slot, amaxes)
    y.backward(torch.randn_like(y))
    for slot in range(G):
        assert (bwd.scale[slot] != 1) == (SPLITS[slot] > 0), (slot, bwd.scale)
    # each group's scale comes from its own rows
    assert len({float(bwd.scale[i]) for i, m in enumerate(SPLITS) if m}) > 1


@pytest.mark.parametrize("recipe", [None, "current"])
def test_grouped_linear_in_sequential_with_leading_dimensions(recipe):
    torch.manual_seed(2)
    first = build(num_groups=2, in_features=32, out_features=64, seed=3)
    second = build(num_groups=3, in_features=64, out_features=32, seed=4, bias=False)
    model = ops.Sequential(first, ops.GELU(), second)
    x = torch.randn(4, 16, 32, requires_grad=True)
    s1, s2 = torch.tensor([48, 16]), torch.tensor([16, 32, 16])
    with autocast_by_name(recipe):
        y = model(x, s1, s2)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert y.shape == (4, 16, 32)

    xr = x.detach().double().requires_grad_()
    params = {p: p.detach().double().requires_grad_() for p in model.parameters()}
    h = torch.cat(
        [
            F.linear(
                r,
                params[first.get_parameter(f"weight{i}")],
                params[first.get_parameter(f"bias{i}")],
            )
            for i, r in enumerate(xr.reshape(-1, 32).split([48, 16]))
        ]
    )
    h = F.gelu(h, approximate="tanh")
    yr = torch.cat(
        [
            F.linear(r, params[second.get_parameter(f"weight{i}")])
            for i, r in enumerate(h.split([16, 32, 16]))
        ]
    ).reshape(4, 16, 32)
    yr.backward(dy.double())
    fwd_key = ("same_values", torch.float32) if recipe is None else ("e4m3", torch.float32)
    bwd_key = ("same_values", torch.float32) if recipe is None else ("hybrid", torch.float32)
    assert_close_by_table(y, yr, fwd_key)
    assert_close_by_table(x.grad, xr.grad, bwd_key)
    for p, ref in params.items():
        assert_close_by_table(p.grad, ref.grad, bwd_key if p.dim() == 2 else fwd_key)


def test_grouped_linear_empty_groups_and_no_bias():
    op = build(num_groups=3, bias=False)
    assert [n for n, _ in op.named_parameters()] == ["weight0", "weight1", "weight2"]
    assert op.bias0 is None and op.biases() == [None, None, None]
    x = torch.randn(16, IN, requires_grad=True)
    with autocast_by_name("current"):
        y = op(x, [0, 16, 0])
    y.sum().backward()
    assert torch.equal(op.weight0.grad, torch.zeros_like(op.weight0))
    assert torch.equal(op.weight2.grad, torch.zeros_like(op.weight2))
    assert op.weight1.grad.abs().sum() > 0
    # no rows at all
    x0 = torch.randn(0, IN, requires_grad=True)
    y0 = op(x0, [0, 0, 0])
    assert y0.shape == (0, OUT)
    y0.sum().backward()
    assert x0.grad.shape == (0, IN)


def test_grouped_linear_frozen_weights_and_input_without_grad():
    op = build(num_groups=2)
    for p in op.parameters():
        p.requires_grad_(False)
    x = torch.randn(32, IN, requires_grad=True)
    with autocast_by_name("delayed"):
        y = op(x, [16, 16])
    y.sum().backward()
    assert x.grad is not None and all(p.grad is None for p in op.parameters())
    # group 1: frozen weight, input without gradient, trainable bias: no GEMM, only the bias
    op.weight0.requires_grad_(True)
    op.bias1.requires_grad_(True)
    dy = torch.randn(32, OUT)
    with autocast_by_name("delayed"):
        y = op(torch.randn(32, IN), [16, 16])
    y.backward(dy)
    assert op.weight0.grad is not None and op.weight1.grad is None and op.bias0.grad is None
    torch.testing.assert_close(op.bias1.grad, dy[16:].sum(dim=0))


def test_grouped_linear_accumulates_into_main_grad():
    op = build(num_groups=2, accumulate_into_main_grad=True)
    for w in op.weights():
        w.main_grad = torch.ones(w.shape)
    x, dy = torch.randn(32, IN), torch.randn(32, OUT)
    op(x, [8, 24]).backward(dy)
    for i, rows in enumerate((slice(0, 8), slice(8, 32))):
        w = op.get_parameter(f"weight{i}")
        assert w.grad is None
        torch.testing.assert_close(w.main_grad, 1 + dy[rows].t() @ x[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", [None, *FP8_RECIPES])
@pytest.mark.parametrize("main_grad", [False, True])
def test_grouped_linear_delay_wgrad_compute_defers_to_backward_dw(recipe, main_grad):
    def run(delay):
        FP8GlobalStateManager.reset()
        op = build(delay_wgrad_compute=delay, accumulate_into_main_grad=main_grad)
        for w in op.weights():
            w.main_grad = torch.zeros(w.shape) if main_grad else None
        model = ops.Sequential(op)
        grads_before = []
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(96, IN, generator=g).requires_grad_(True)
            dy = torch.randn(96, OUT, generator=g)
            with autocast_by_name(recipe):
                y = model(x, torch.tensor(SPLITS))
            y.backward(dy)
            grads_before.append([w.grad for w in op.weights()])
            if delay:
                assert op.need_backward_dw() and len(op.wgrad_store) == G
                op.backward_dw()
                assert op.wgrad_store == []
            else:
                assert not op.need_backward_dw()
        weight_grads = [w.main_grad if main_grad else w.grad for w in op.weights()]
        return weight_grads, [b.grad for b in op.biases()], x.grad, grads_before

    deferred, immediate = run(True), run(False)
    if not main_grad:
        assert all(g is None for g in deferred[3][0])  # nothing before the first backward_dw()
    for a, b in zip(
        deferred[0] + deferred[1] + [deferred[2]], immediate[0] + immediate[1] + [immediate[2]]
    ):
        assert torch.equal(a, b)


def test_grouped_linear_dequantizes_a_quantized_input():
    torch.manual_seed(5)
    op = build(num_groups=2)
    model = ops.Sequential(ops.Quantize(), op)
    x = torch.randn(32, IN, requires_grad=True)
    with autocast_by_name("current"):
        y = model(x, torch.tensor([16, 16]))
    y.sum().backward()
    y_ref, _, _ = reference_run(op, x, torch.ones(32, OUT), [16, 16])
    assert_close_by_table(y, y_ref, ("e4m3", torch.float32))
    assert x.grad.shape == x.shape


def test_grouped_linear_init_is_kaiming_uniform_like_torch_linear():
    torch.manual_seed(6)
    op = ops.GroupedLinear(3, IN, OUT, device="cpu")
    torch.manual_seed(6)
    refs = [torch.nn.Linear(IN, OUT, bias=False) for _ in range(3)]
    for w, ref in zip(op.weights(), refs):
        assert torch.equal(w, ref.weight)
    for b in op.biases():
        assert torch.equal(b, torch.zeros(OUT))


def test_grouped_linear_delayed_scaling_checkpoint_round_trip(tmp_path):
    """Every group's scales survive a weights_only checkpoint into a meta-built operation."""
    op = build(num_groups=3, in_features=32, out_features=32)
    x = torch.randn(32, 32, requires_grad=True)
    with autocast_by_name("delayed"):
        op(x, [16, 0, 16]).sum().backward()
    torch.save(op.state_dict(), tmp_path / "op.pt")
    restored = ops.GroupedLinear(3, 32, 32, device="meta")
    restored.load_state_dict(torch.load(tmp_path / "op.pt", weights_only=True), assign=True)
    with autocast_by_name("delayed"):
        expected, actual = op(x, [16, 0, 16]), restored(x, [16, 0, 16])
    assert torch.equal(actual, expected)
    for mode in ("forward", "backward"):
        assert torch.equal(restored.recipe_state(mode).scale, op.recipe_state(mode).scale)
        assert restored.recipe_state(mode).device.type == "cpu"


@pytest.mark.parametrize(
    "splits, error, match",
    [
        ([16, 16], ValueError, "2 entries but num_groups=3"),
        (torch.tensor([16, 16, 8]), ValueError, "sum to 40"),
        ([16, 32, -16], ValueError, "non-negative"),
        ([16.0, 16, 0], ValueError, "ints"),
        (torch.tensor([16.0, 16.0, 0.0]), ValueError, "integer tensor"),
        (torch.tensor([[16, 16, 0]]), ValueError, "1-D"),
        (torch.tensor([True, False, True]), ValueError, "integer tensor"),
        (16, ValueError, "list of ints"),
    ],
)
def test_grouped_linear_split_size_errors(splits, error, match):
    op = build(num_groups=3)
    with pytest.raises(error, match=match):
        op(torch.randn(32, IN), splits)
    # through a fuser (and Sequential) the same checks apply to the extra input
    if isinstance(splits, torch.Tensor):
        with pytest.raises(error, match=match):
            OperationFuser([op])(torch.randn(32, IN), splits)


def test_grouped_linear_argument_errors():
    op = build(num_groups=2)
    with pytest.raises(ValueError, match="in_features=64"):
        op(torch.randn(32, 24), [16, 16])
    with pytest.raises(ValueError, match="expected 1 extra inputs"):
        OperationFuser([op])(torch.randn(32, IN))
    with pytest.raises(ValueError, match="expected 1 extra inputs"):
        ops.Sequential(op)(torch.randn(32, IN))
    with pytest.raises(ValueError, match="out_features to be a multiple of 16"):
        with autocast_by_name("delayed"):
            build(num_groups=2, out_features=40)(torch.randn(32, IN), [8, 24])
    for kwargs, name in (
        ({"single_grouped_weight": True}, "single_grouped_weight"),
        ({"single_grouped_bias": True}, "single_grouped_bias"),
        ({"scale_bias": True}, "scale_bias"),
    ):
        with pytest.raises(NotImplementedError, match=name):
            ops.GroupedLinear(2, 32, 32, device="cpu", **kwargs)
    with pytest.raises(ValueError, match="num_groups"):
        ops.GroupedLinear(0, 32, 32, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        ops.GroupedLinear(2, 32, 32, device="cpu", dtype=torch.int32)


# ------------------------------------------------------------------------------------------
# GroupedLinear deferred initialization

DEFERRED_CASES = [(r, False) for r in (None, "delayed", "current")] + [
    (r, True) for r in ("delayed", "current")
]
DEFERRED_IDS = [f"{r}{'-fp8weights' if q else ''}" for r, q in DEFERRED_CASES]
D_SPLITS = [16, 0, 16]


def build_meta(recipe=None, fp8_weights=False, **kwargs):
    if not fp8_weights:
        return ops.GroupedLinear(3, 32, 32, device="meta", **kwargs)
    with te.quantized_model_init(recipe=FP8_RECIPES[recipe]()):
        return ops.GroupedLinear(3, 32, 32, device="meta", **kwargs)


def check_live(op, device, recipe=None):
    params = list(op.parameters())
    assert len(params) == 6 and len({id(p) for p in params}) == 6
    assert all(isinstance(p, torch.nn.Parameter) and p.device == device for p in params)
    assert [id(p) for p in params] == [id(p) for p in op.weights() + op.biases()]
    for mode in ("forward", "backward"):
        state = op.recipe_state(mode)
        assert (state is None) == (recipe is None) or op._quantizers is None
        assert state is None or state.device == device


def test_grouped_linear_meta_construction_holds_no_storage():
    op = build_meta()
    assert all(p.is_meta for p in op.parameters()) and op._fp8_metas is None


@pytest.mark.parametrize("recipe, fp8_weights", DEFERRED_CASES, ids=DEFERRED_IDS)
def test_grouped_linear_first_forward_materializes_and_trains(recipe, fp8_weights):
    op = build_meta(recipe, fp8_weights)
    x = torch.randn(32, 32, requires_grad=True)
    with autocast_by_name(recipe):
        y = op(x, D_SPLITS)
    y.backward(torch.ones_like(y))
    cpu = torch.device("cpu")
    check_live(op, cpu, recipe)
    assert x.grad.device == cpu and x.grad.shape == x.shape
    for p in op.parameters():
        assert p.grad is not None and p.grad.device == cpu and p.grad.shape == p.shape
    if fp8_weights:
        assert all(isinstance(w, te.Float8Tensor) for w in op.weights())
    # an optimizer built after materialization trains exactly the live parameters
    params = list(op.parameters())
    before = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.SGD(op.parameters(), lr=0.5)
    target = torch.randn(32, 32, generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        with autocast_by_name(recipe):
            loss = F.mse_loss(op(x.detach(), D_SPLITS), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in held] == [id(p) for p in op.parameters()] == [id(p) for p in params]
    # group 1 is empty: its parameters see zero gradients and stay (an FP8 weight may still
    # be re-quantized with a new scale); the others move
    moved = [not torch.equal(b, p.detach().float()) for b, p in zip(before, params)]
    expected = [True, False, True, True, False, True]
    if fp8_weights:
        moved, expected = moved[:1] + moved[2:], expected[:1] + expected[2:]
    assert moved == expected
    check_live(op, cpu, recipe)


def test_grouped_linear_reset_parameters_materializes_like_eager_construction():
    default = materialization_device()  # the current CUDA device, else the CPU
    torch.manual_seed(7)
    eager_default = ops.GroupedLinear(3, 32, 32, device=default)
    torch.manual_seed(7)
    deferred = build_meta()
    deferred.reset_parameters()
    check_live(deferred, default)
    for a, b in zip(eager_default.parameters(), deferred.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(7)
    eager = ops.GroupedLinear(3, 32, 32, device="cpu")
    torch.manual_seed(7)
    on_first_forward = build_meta()
    x = torch.randn(32, 32)
    torch.manual_seed(7)
    ops.Sequential(on_first_forward)(x, torch.tensor(D_SPLITS))
    for a, b in zip(eager.parameters(), on_first_forward.parameters()):
        assert torch.equal(a, b)
    # reset of a materialized operation keeps the Parameter objects (optimizers hold them)
    params = list(eager.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    torch.manual_seed(7)
    eager.reset_parameters()
    assert [id(p) for p in eager.parameters()] == [id(p) for p in params]
    for a, b in zip(eager.parameters(), on_first_forward.parameters()):  # both on the CPU
        assert torch.equal(a, b)
    # to_empty, then reset_parameters
    torch.manual_seed(7)
    emptied = build_meta().to_empty(device="cpu")
    emptied.reset_parameters()
    for a, b in zip(emptied.parameters(), on_first_forward.parameters()):
        assert torch.equal(a, b)


def test_grouped_linear_fuser_made_before_materialization_uses_the_live_parameters():
    op = build_meta()
    model = ops.Sequential(ops.RMSNorm(32, device="meta"), op)
    model._get_module_groups()  # fusers made while everything is meta
    x = torch.randn(32, 32, requires_grad=True)
    with autocast_by_name("delayed"):
        model(x, torch.tensor(D_SPLITS)).sum().backward()
    assert all(p.device.type == "cpu" and p.grad is not None for p in model.parameters())
    check_live(op, torch.device("cpu"), "delayed")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_grouped_linear_fp8_weights_keep_their_high_precision_init_values(recipe):
    with te.quantized_model_init(
        recipe=FP8_RECIPES[recipe](), preserve_high_precision_init_val=True
    ):
        op = ops.GroupedLinear(2, 32, 32, device="meta")
    with pytest.warns(UserWarning, match="dequantized"):
        op(torch.randn(32, 32), [16, 16])
    for w in op.weights():
        assert isinstance(w, te.Float8Tensor) and w.device.type == "cpu"
        init = w.get_high_precision_init_val()
        torch.testing.assert_close(w.dequantize(), init, rtol=0.125, atol=1e-2)
    with (
        pytest.raises(ValueError, match="same recipe class"),
        autocast_by_name("current" if recipe == "delayed" else "delayed"),
    ):
        op(torch.randn(32, 32), [16, 16])


@needs_two_gpus
@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_gpu_grouped_linear_meta_on_cuda1_while_cuda0_is_current(recipe):
    torch.cuda.set_device(0)
    dev1 = torch.device("cuda", 1)
    op = ops.GroupedLinear(3, 32, 32, device="meta", dtype=torch.bfloat16)
    x = torch.randn(32, 32, device=dev1, dtype=torch.bfloat16, requires_grad=True)
    with autocast_by_name(recipe):
        y = op(x, D_SPLITS)
    assert torch.cuda.current_device() == 0
    y.float().square().mean().backward()
    assert torch.cuda.current_device() == 0
    check_live(op, dev1, recipe)
    assert y.device == dev1 and x.grad.device == dev1
    assert all(p.grad is not None and p.grad.device == dev1 for p in op.parameters())


def test_split_sizes_through_sequential_must_be_a_tensor():
    seq = te.ops.Sequential(te.ops.GroupedLinear(2, 16, 16, device="cpu"))
    x = torch.randn(32, 16)
    with pytest.raises(TypeError, match=r"extra input 0 must be a torch.Tensor, got list"):
        seq(x, [16, 16])
    assert seq(x, torch.tensor([16, 16])).shape == (32, 16)
