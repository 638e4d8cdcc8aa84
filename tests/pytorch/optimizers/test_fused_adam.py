"""te.optimizers.FusedAdam against torch.optim.AdamW / Adam in float64 (float32 on float32 copies
of low-precision parameters) and Adam written out in float64 (FP8 weights: test_fused_adam_fp8)."""

import warnings

import pytest
import torch

from transformer_engine.pytorch.optimizers import FusedAdam

SHAPES = [(8, 5), (13,), (2, 3, 4)]
# Two parameter groups with different learning rates (and betas for the second).
GROUPS = [([0, 1], dict(lr=1e-2)), ([2], dict(lr=3e-3, betas=(0.8, 0.99)))]
STEPS = 4


def initial(dtype=torch.float32):
    return [torch.randn(s).to(dtype) for s in SHAPES]


def gradients(steps=STEPS, dtype=torch.float32):
    return [initial(dtype) for _ in range(steps)]


def grouped(params, groups=GROUPS):
    return [dict(params=[params[i] for i in idx], **kw) for idx, kw in groups]


def run_torch(cls, start, grads, dtype=torch.float64, groups=GROUPS, **kw):
    """A torch optimizer on ``dtype`` copies of ``start``, stepped with ``grads`` (no weight
    decay unless given: AdamW's default is 0.01, FusedAdam's 0)."""
    kw.setdefault("weight_decay", 0.0)
    params = [torch.nn.Parameter(p.to(dtype, copy=True)) for p in start]
    opt = cls(grouped(params, groups), **kw)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


def copies(start):
    return [torch.nn.Parameter(p.clone()) for p in start]


def run_fused(start, grads, groups=GROUPS, **kw):
    params = copies(start)
    opt = FusedAdam(grouped(params, groups), **kw)
    for step_grads in grads:
        step_with(opt, params, step_grads)
    return params, opt


def step_with(opt, params, step_grads):
    for p, g in zip(params, step_grads):
        p.grad = g.to(p.dtype, copy=True)
    opt.step()


def assert_close32(got, ref):
    """A float32 computation against float64: about 1e-6 relative."""
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-6, atol=1e-6)


def within_one_rounding(got, ref, dtype):
    """``got`` (in ``dtype``) is ``ref`` rounded to ``dtype``, give or take one rounding."""
    err = (got.double() - ref.double()).abs()
    return bool((err <= torch.finfo(dtype).eps * ref.double().abs() + 1e-30).all())


# --- against torch and the formula ---
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adamw_matches_torch_adamw(weight_decay):
    start, grads = initial(), gradients()
    ours, opt = run_fused(start, grads, weight_decay=weight_decay)
    ref, ref_opt = run_torch(torch.optim.AdamW, start, grads, weight_decay=weight_decay)
    for p, r in zip(ours, ref):
        assert_close32(p, r)
        assert_close32(opt.state[p]["exp_avg"], ref_opt.state[r]["exp_avg"])
        assert_close32(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
    assert [g["step"] for g in opt.param_groups] == [STEPS, STEPS]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]


def test_adam_l2_mode_matches_torch_adam():
    start, grads = initial(), gradients()
    ours, _ = run_fused(start, grads, weight_decay=0.1, adam_w_mode=False)
    ref, _ = run_torch(torch.optim.Adam, start, grads, weight_decay=0.1)
    for p, r in zip(ours, ref):
        assert_close32(p, r)


def adam_by_hand(start, grads, *, lrs, betas, eps, wd, adam_w_mode, bias_correction):
    """Adam written out in float64, one learning rate and betas pair per parameter."""
    out = []
    for i, p0 in enumerate(start):
        p, m, v = p0.double(), torch.zeros(p0.shape).double(), torch.zeros(p0.shape).double()
        beta1, beta2 = betas[i]
        for step, step_grads in enumerate(grads, start=1):
            g = step_grads[i].double()
            if not adam_w_mode:
                g = g + wd * p
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            if bias_correction:
                update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
            else:
                update = m / (v.sqrt() + eps)
            if adam_w_mode:
                update = update + wd * p
            p = p - lrs[i] * update
        out.append(p)
    return out


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_hand_formula(adam_w_mode, bias_correction):
    start, grads = initial(), gradients()
    ours, _ = run_fused(start, grads, weight_decay=0.05, eps=1e-6, adam_w_mode=adam_w_mode,
                        bias_correction=bias_correction)  # fmt: skip
    expected = adam_by_hand(start, grads, lrs=[1e-2, 1e-2, 3e-3],
                            betas=[(0.9, 0.999)] * 2 + [(0.8, 0.99)], eps=1e-6, wd=0.05,
                            adam_w_mode=adam_w_mode, bias_correction=bias_correction)  # fmt: skip
    for p, e in zip(ours, expected):
        assert_close32(p, e)


# --- master weights and remainders ---
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master_weights", [True, False])
def test_low_precision_params(dtype, master_weights):
    """Against a float32 oracle on float32 copies; without masters a single step (the rounding
    of each step would accumulate)."""
    start, grads = initial(dtype), gradients(STEPS if master_weights else 1, dtype=dtype)
    ours, opt = run_fused(start, grads, master_weights=master_weights, weight_decay=0.05)
    ref, _ = run_torch(torch.optim.AdamW, start, grads, dtype=torch.float32, weight_decay=0.05)
    for p, r in zip(ours, ref):
        assert p.dtype == dtype and ("master_param" in opt.state[p]) == master_weights
        if master_weights:
            assert opt.state[p]["master_param"].dtype == torch.float32
            torch.testing.assert_close(
                opt.state[p]["master_param"], r.detach(), rtol=1e-5, atol=1e-6
            )
        assert within_one_rounding(p, r.detach(), dtype)


def test_float16_master_weights():
    start, grads = initial(), gradients(3)
    ours, opt = run_fused(start, grads, master_weights=True, master_weight_dtype=torch.float16)
    ref, _ = run_torch(torch.optim.AdamW, start, grads)
    for p, r in zip(ours, ref):
        assert opt.state[p]["master_param"].dtype == torch.float16
        master = opt.get_unscaled_state(p, "master_param")
        assert master.dtype == torch.float32
        # One float16 rounding at the start and one per step (stored scaled: no underflow).
        torch.testing.assert_close(master.double(), r.detach(), rtol=4 * 2**-11, atol=1e-6)
        assert torch.equal(p.detach(), master), "the parameter receives the master's value"


def test_store_param_remainders_bf16():
    start, grads = initial(torch.bfloat16), gradients(dtype=torch.bfloat16)
    ours, opt = run_fused(start, grads, master_weights=True, store_param_remainders=True,
                          weight_decay=0.05)  # fmt: skip
    ref, _ = run_torch(torch.optim.AdamW, start, grads, dtype=torch.float32, weight_decay=0.05)
    for p, r in zip(ours, ref):
        assert opt.state[p]["master_param"].dtype == torch.int16, "only the low 16 bits kept"
        master = opt.get_unscaled_state(p, "master_param")
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(master, master.bfloat16().float()), "a real float32 master"
        # The parameter is the master rounded to nearest, ties away from zero.
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(p.detach()[~tie], master.bfloat16()[~tie])
        if tie.any():
            assert (p.detach()[tie].float().abs() > master[tie].abs()).all()


def test_remainder_master_ties_round_away_from_zero():
    # Halfway between two bfloat16s: ties to even would give 1.0, -1.0 and 3.0.
    master = torch.tensor([1.0 + 2.0**-8, -(1.0 + 2.0**-8), 3.0 + 2.0**-7])
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p32 = torch.nn.Parameter(torch.zeros(3))  # not bfloat16: a whole float32 master
    opt = FusedAdam([p, p32], lr=0.0, master_weights=True, store_param_remainders=True)
    opt.initialize_state(p32, True)
    assert opt.state[p32]["master_param"].dtype == torch.float32
    opt.set_scaled_state(p, "master_param", master)
    assert p.tolist() == [1.0078125, -1.0078125, 3.015625]
    assert torch.equal(opt.get_unscaled_state(p, "master_param"), master)
    p.grad = torch.zeros(3, dtype=torch.bfloat16)
    opt.step()  # a zero step keeps both halves
    assert p.tolist() == [1.0078125, -1.0078125, 3.015625]
    assert torch.equal(opt.get_unscaled_state(p, "master_param"), master)


# --- moment dtypes ---
# (rtol, amax-relative floor) of one stored rounding: a full ulp relative (twice the half-ulp a
# round to nearest makes), and the scaled dtypes' smallest subnormal step relative to the amax.
PRECISION = {
    torch.float32: (1e-6, 0.0),
    torch.bfloat16: (2.0**-7, 0.0),
    torch.float16: (2.0**-10, 2.0**-24 / 65504.0),
    torch.uint8: (2.0**-3, 2.0**-9 / 448.0),
}


def close_in(dtype, got, ref, terms):
    """``got`` is ``ref = sum(terms)`` stored once in ``dtype``: one rounding (relative, or the
    subnormal floor relative to the tensor's amax), plus float32 arithmetic on the terms."""
    rtol, floor = PRECISION[dtype]
    err = (got.double() - ref).abs()
    arithmetic = 1e-6 * sum(t.abs() for t in terms)
    bound = rtol * ref.abs() + floor * ref.abs().max() + arithmetic + 1e-12
    return bool((err <= bound).all())


def close_after(dtype, got, exact, steps):
    """Errors of one rounding per step, each within an ulp of the largest moment."""
    rtol = max(PRECISION[dtype][0], 1e-6)
    return bool(((got.double() - exact).abs() <= steps * rtol * exact.abs().max()).all())


# fmt: off
MOMENT_DTYPES = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                 (torch.uint8, torch.uint8), (torch.bfloat16, torch.uint8),
                 (torch.float32, torch.float16)]
# fmt: on


def moments64(opt, p):
    """The stored moments in float64 (zeros before the first step)."""
    if not opt.state[p]:
        return torch.zeros(p.shape).double(), torch.zeros(p.shape).double()
    return tuple(opt.get_unscaled_state(p, name).double() for name in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("avg_dtype,sq_dtype", MOMENT_DTYPES)
def test_moment_dtypes(avg_dtype, sq_dtype):
    beta1, beta2 = 0.9, 0.999
    start, grads = initial(), gradients(3)
    params = copies(start)
    opt = FusedAdam(params, lr=1e-3, betas=(beta1, beta2), exp_avg_dtype=avg_dtype,
                    exp_avg_sq_dtype=sq_dtype)  # fmt: skip
    exact_m = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    exact_v = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for k, step_grads in enumerate(grads, start=1):
        prev = [moments64(opt, p) for p in params]
        step_with(opt, params, step_grads)
        for i, (p, g, (m0, v0)) in enumerate(zip(params, step_grads, prev)):
            g = g.double()
            m = opt.get_unscaled_state(p, "exp_avg")
            v = opt.get_unscaled_state(p, "exp_avg_sq")
            assert m.dtype == v.dtype == torch.float32
            assert opt.state[p]["exp_avg"].dtype == avg_dtype
            assert opt.state[p]["exp_avg_sq"].dtype == sq_dtype
            # This step: the formula on the previous stored moments, rounded once.
            m_terms = (beta1 * m0, (1 - beta1) * g)
            v_terms = (beta2 * v0, (1 - beta2) * g * g)
            assert close_in(avg_dtype, m, sum(m_terms), m_terms)
            assert close_in(sq_dtype, v, sum(v_terms), v_terms)
            # The whole run: the exact moments, within one rounding per step.
            exact_m[i] = beta1 * exact_m[i] + (1 - beta1) * g
            exact_v[i] = beta2 * exact_v[i] + (1 - beta2) * g * g
            assert close_after(avg_dtype, m, exact_m[i], k)
            assert close_after(sq_dtype, v, exact_v[i], k)
    for p in params:
        assert torch.isfinite(p).all()


def test_set_and_get_scaled_state():
    p = torch.nn.Parameter(torch.randn(64))
    opt = FusedAdam([p], exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16)
    value = torch.randn(64) * 1e-5
    opt.set_scaled_state(p, "exp_avg", value)
    opt.set_scaled_state(p, "exp_avg_sq", value.abs())
    assert opt.state[p]["exp_avg"].dtype == torch.uint8
    v64 = value.double()
    assert close_in(torch.uint8, opt.get_unscaled_state(p, "exp_avg"), v64, [v64])
    assert close_in(torch.float16, opt.get_unscaled_state(p, "exp_avg_sq"), v64.abs(), [v64])
    with pytest.raises(KeyError):
        opt.set_scaled_state(p, "momentum", value)
    with pytest.raises(ValueError):
        opt.set_scaled_state(p, "master_param", value)


# --- checkpoints ---
def test_state_dict_values_are_float32():
    params = [torch.nn.Parameter(p) for p in initial(torch.bfloat16)]
    opt = FusedAdam(params, master_weights=True, master_weight_dtype=torch.float16,
                    exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)  # fmt: skip
    step_with(opt, params, gradients(1, torch.bfloat16)[0])
    sd = opt.state_dict()
    assert len(sd["state"]) == len(params)
    for index, entry in sd["state"].items():
        assert set(entry) == {"exp_avg", "exp_avg_sq", "master_param"}
        for name, value in entry.items():
            assert value.dtype == torch.float32, name
            assert torch.equal(value, opt.get_unscaled_state(params[index], name))


def test_load_state_dict_into_other_state_dtypes_continues_training():
    start, grads = initial(), gradients()
    # Uninterrupted: four steps with float32 moments.
    full, _ = run_fused(start, grads, weight_decay=0.05)
    # Interrupted: two steps, a checkpoint, two more steps in an optimizer keeping bfloat16 and
    # (scaled) float16 moments.
    first, opt = run_fused(start, grads[:2], weight_decay=0.05)
    sd = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = FusedAdam(grouped(resumed), weight_decay=0.05, exp_avg_dtype=torch.bfloat16,
                     exp_avg_sq_dtype=torch.float16)  # fmt: skip
    opt2.load_state_dict(sd)
    assert [g["step"] for g in opt2.param_groups] == [2, 2]
    for p, q in zip(resumed, first):
        assert opt2.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt2.state[p]["exp_avg_sq"].dtype == torch.float16
        saved = opt.state[q]["exp_avg"].double()
        assert close_in(torch.bfloat16, opt2.get_unscaled_state(p, "exp_avg"), saved, [saved])
    for step_grads in grads[2:]:
        step_with(opt2, resumed, step_grads)
    ref, _ = run_torch(torch.optim.AdamW, start, grads, weight_decay=0.05)
    for p, f, r in zip(resumed, full, ref):
        # Two steps on moments rounded to bfloat16 / float16: updates off by ~2**-8 relative.
        torch.testing.assert_close(p, f, rtol=0, atol=2 * 1e-2 * 2**-6)
        torch.testing.assert_close(p.double(), r, rtol=0, atol=2 * 1e-2 * 2**-6)
    assert [g["step"] for g in opt2.param_groups] == [STEPS, STEPS]


def test_checkpoint_float32_master_survives_for_bf16_params():
    """torch's load_state_dict casts state to the parameter's dtype; the master must not be."""
    start, grads = initial(torch.bfloat16), gradients(dtype=torch.bfloat16)
    full, _ = run_fused(start, grads, master_weights=True, store_param_remainders=True)
    first, opt = run_fused(start, grads[:2], master_weights=True, store_param_remainders=True)
    sd = opt.state_dict()
    masters = [sd["state"][i]["master_param"] for i in range(len(first))]
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = FusedAdam(grouped(resumed), master_weights=True)  # whole float32 masters
    opt2.load_state_dict(sd)
    for p, master in zip(resumed, masters):
        assert master.dtype == torch.float32
        assert not torch.equal(master, master.bfloat16().float())
        assert opt2.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(opt2.state[p]["master_param"], master)
    for step_grads in grads[2:]:
        step_with(opt2, resumed, step_grads)
    ref, _ = run_torch(torch.optim.AdamW, start, grads, dtype=torch.float32)
    for p, f, r in zip(resumed, full, ref):
        torch.testing.assert_close(opt2.state[p]["master_param"], r.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p, f), "the same float32 masters, moments and steps"


def test_load_float32_master_into_remainders():
    start, grads = initial(torch.bfloat16), gradients(2, dtype=torch.bfloat16)
    first, opt = run_fused(start, grads, master_weights=True)
    sd = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = FusedAdam(grouped(resumed), master_weights=True, store_param_remainders=True)
    opt2.load_state_dict(sd)
    for i, p in enumerate(resumed):
        master = sd["state"][i]["master_param"]
        assert opt2.state[p]["master_param"].dtype == torch.int16
        assert torch.equal(opt2.get_unscaled_state(p, "master_param"), master)
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(p.detach()[~tie], master.bfloat16()[~tie])


# --- arguments ---
# fmt: off
INVALID = [
    dict(lr=-1e-3), dict(lr=float("nan")), dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.1)),
    dict(betas=(0.9,)), dict(eps=-1.0), dict(weight_decay=-0.1),
    dict(master_weight_dtype=torch.bfloat16), dict(exp_avg_dtype=torch.float64),
    dict(exp_avg_sq_dtype=torch.int8),
    # capturable: float32 masters, both moments float32 or both bfloat16, no remainders
    dict(capturable=True, master_weights=True, master_weight_dtype=torch.float16),
    dict(capturable=True, exp_avg_dtype=torch.bfloat16),
    dict(capturable=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    dict(capturable=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    dict(capturable=True, master_weights=True, store_param_remainders=True),
]
# fmt: on


@pytest.mark.parametrize("kwargs", INVALID, ids=lambda kw: ",".join(kw))
def test_invalid_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_amsgrad_and_sparse_gradients_raise_runtime_error():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(RuntimeError):
        FusedAdam([p], amsgrad=True)
    p.grad = torch.sparse_coo_tensor([[1]], [1.0], (4,))
    with pytest.raises(RuntimeError):
        FusedAdam([p]).step()


# --- capturable on the CPU ---
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_capturable_matches_torch(adam_w_mode):
    """lr and step become one-element tensors; a new lr is written into the tensor."""
    start, grads = initial(), gradients()
    params = copies(start)
    opt = FusedAdam(grouped(params), capturable=True, weight_decay=0.05, adam_w_mode=adam_w_mode)
    ref = [torch.nn.Parameter(p.double()) for p in start]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = cls(grouped(ref), weight_decay=0.05)
    for k, step_grads in enumerate(grads):
        if k == 2:
            opt.param_groups[0]["lr"].fill_(5e-3)
            ref_opt.param_groups[0]["lr"] = float(torch.tensor(5e-3, dtype=torch.float32))
        step_with(opt, params, step_grads)
        step_with(ref_opt, ref, step_grads)
    for group in opt.param_groups:
        assert isinstance(group["lr"], torch.Tensor) and isinstance(group["step"], torch.Tensor)
        assert group["step"].item() == STEPS
    for p, r in zip(params, ref):
        # Bias corrections from a float32 step count: slightly looser than 1e-6.
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-6)


def test_capturable_master_weights_bf16():
    start, grads = initial(torch.bfloat16), gradients(dtype=torch.bfloat16)
    ours, opt = run_fused(start, grads, capturable=True, master_weights=True)
    ref, _ = run_torch(torch.optim.AdamW, start, grads)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(opt.state[p]["master_param"].double(), r, rtol=2e-6, atol=2e-6)
        assert torch.equal(p.detach(), opt.state[p]["master_param"].bfloat16())


# --- gradients, closures, zero_grad ---
def test_use_decoupled_grad():
    start, grads = initial(), gradients()
    params = copies(start)
    opt = FusedAdam(grouped(params), use_decoupled_grad=True)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.full(p.shape, 1e3)  # not read
            p.decoupled_grad = g.clone()
        opt.step()
    for p, r in zip(params, run_torch(torch.optim.AdamW, start, grads)[0]):
        assert_close32(p, r)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in params)
    lone = torch.nn.Parameter(torch.ones(3))
    lone.grad = torch.ones(3)  # a .grad but no decoupled_grad: skipped
    FusedAdam([lone], use_decoupled_grad=True).step()
    assert torch.equal(lone, torch.ones(3))


@pytest.mark.parametrize("set_grad_none", [None, True, False])
def test_zero_grad_and_deprecated_set_grad_none(set_grad_none):
    p = torch.nn.Parameter(torch.ones(3))
    if set_grad_none is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = FusedAdam([p])
    else:
        with pytest.warns(DeprecationWarning):
            opt = FusedAdam([p], set_grad_none=set_grad_none)
    p.grad = torch.ones(3)
    opt.zero_grad()  # the default: set_grad_none where given, else None
    if set_grad_none is False:
        assert torch.equal(p.grad, torch.zeros(3))
    else:
        assert p.grad is None
    grad = torch.ones(3)
    p.grad = grad
    opt.zero_grad(set_to_none=False)
    assert p.grad is grad and torch.equal(grad, torch.zeros(3))
    opt.zero_grad(set_to_none=True)
    assert p.grad is None


def test_closure_loss_is_returned():
    w0, x = torch.randn(5), torch.randn(5)
    w = torch.nn.Parameter(w0.clone())
    opt = FusedAdam([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * x).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() == pytest.approx(float((w0 * x).sum()), rel=1e-6)
    ref, _ = run_torch(torch.optim.AdamW, [w0], [[x]], groups=[([0], dict(lr=0.1))])
    assert_close32(w, ref[0])
    assert opt.step() is None


def test_params_without_grad_are_skipped():
    start, grads = initial(), gradients(2)
    params = copies(start)
    opt = FusedAdam(grouped(params))
    for step_grads in grads:
        params[0].grad = step_grads[0].clone()
        params[2].grad = step_grads[2].clone()
        opt.step()
    assert torch.equal(params[1], start[1]) and len(opt.state[params[1]]) == 0
    ref, _ = run_torch(torch.optim.AdamW, start, grads)
    assert_close32(params[0], ref[0])
    assert_close32(params[2], ref[2])


# --- loss scaling ---
def make_scaler(init_scale):
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scaler.scale(torch.ones(()))  # the scale tensor is created at the first scale()
    return scaler


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("init_scale", [1024.0, 3000.0])
def test_grad_scaler_equals_unscaled_step(capturable, init_scale):
    start, grads = initial(), gradients()
    params = copies(start)
    opt = FusedAdam(grouped(params), capturable=capturable, weight_decay=0.05)
    scaler = make_scaler(init_scale)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g * init_scale
        opt.step(grad_scaler=scaler)
    ref, _ = run_torch(torch.optim.AdamW, start, grads, weight_decay=0.05)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_grad_scaler_nonfinite_gradient_changes_nothing(capturable, bad):
    start, grads = initial(), gradients(3)
    params = copies(start)
    opt = FusedAdam(grouped(params), capturable=capturable)
    scaler = make_scaler(256.0)

    def scaled_step(step_grads):
        for p, g in zip(params, step_grads):
            p.grad = g * 256.0
        opt.step(grad_scaler=scaler)

    scaled_step(grads[0])
    names = ("exp_avg", "exp_avg_sq")
    before = [[p.detach().clone()] + [opt.state[p][n].clone() for n in names] for p in params]
    steps = [int(g["step"]) for g in opt.param_groups]
    bad_grads = [g.clone() for g in grads[1]]
    bad_grads[1][4] = bad
    scaled_step(bad_grads)
    for p, kept in zip(params, before):
        assert all(torch.equal(a, b) for a, b in zip([p] + [opt.state[p][n] for n in names], kept))
    assert [int(g["step"]) for g in opt.param_groups] == steps == [1, 1]
    # Training goes on as if the skipped step had not happened.
    scaled_step(grads[2])
    ref, _ = run_torch(torch.optim.AdamW, start, [grads[0], grads[2]])
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.double(), r, rtol=2e-6, atol=2e-6)


def test_grad_scaler_before_its_first_scale_call():
    # Regression: the scaler's scale tensor is None until its first scale() call.
    start, grads = initial(), gradients(1)
    params = copies(start)
    for p, g in zip(params, grads[0]):
        p.grad = g * 64.0
    FusedAdam(grouped(params)).step(grad_scaler=torch.amp.GradScaler("cpu", init_scale=64.0))
    for p, r in zip(params, run_torch(torch.optim.AdamW, start, grads)[0]):
        assert_close32(p, r)


@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_with_an_empty_parameter(capturable):
    # Regression: the inf check's _foreach_norm(inf) raised on a zero-element gradient.
    start, grads = [torch.randn(5), torch.zeros(0)], [[torch.randn(5), torch.zeros(0)]]
    params = copies(start)
    for p, g in zip(params, grads[0]):
        p.grad = g * 8.0
    FusedAdam(params, capturable=capturable).step(grad_scaler=make_scaler(8.0))
    ref, _ = run_torch(torch.optim.AdamW, start, grads, groups=[([0, 1], {})])
    torch.testing.assert_close(params[0].double(), ref[0], rtol=2e-6, atol=2e-6)
