"""The multi-tensor operations of transformer_engine.pytorch.optimizers against formulas written
out by hand in float64 (norms, scaling, current-scaling scales, one Adam step, one SGD step), and
the applier's handling of its lists (empty slots dropped, ``None`` for nothing, unequal lists
refused)."""

import math

import pytest
import torch

from transformer_engine.pytorch.optimizers import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_param_remainder,
    multi_tensor_applier,
    multi_tensor_compute_scale_and_scale_inv,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
)

SHAPES = [(7,), (4, 16), (3, 5, 2), (1,)]


def noop_flag():
    return torch.zeros(1, dtype=torch.int)


def randn_list(dtype=torch.float32, scale=1.0, shapes=SHAPES):
    return [(torch.randn(s) * scale).to(dtype) for s in shapes]


# --- l2 norms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_l2norm_matches_float64(dtype, per_tensor):
    tensors = randn_list(dtype, scale=3.0)
    total, per = multi_tensor_applier(multi_tensor_l2norm, noop_flag(), [tensors], per_tensor)
    expected_per = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])
    expected_total = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total.double(), expected_total.reshape(1), rtol=1e-6, atol=0)
    if per_tensor:
        assert per.dtype == torch.float32 and per.shape == (len(tensors),)
        torch.testing.assert_close(per.double(), expected_per, rtol=1e-6, atol=0)
    else:
        assert per.numel() == 0


def test_l2norm_of_known_values():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]]), torch.zeros(3)]
    total, per = multi_tensor_applier(multi_tensor_l2norm, noop_flag(), [tensors], True)
    assert total.tolist() == [13.0]
    assert per.tolist() == [5.0, 12.0, 0.0]


@pytest.mark.parametrize("inv_scale", [0.125, 1.0 / 3.0])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_unscale_l2norm_matches_float64(inv_scale, per_tensor):
    tensors = randn_list(torch.float32, scale=1000.0)
    inv = torch.tensor([inv_scale], dtype=torch.float32)
    total, per = multi_tensor_applier(
        multi_tensor_unscale_l2norm, noop_flag(), [tensors], inv, per_tensor
    )
    inv64 = float(inv)
    expected_total = torch.linalg.vector_norm(
        torch.cat([t.double().flatten() * inv64 for t in tensors])
    )
    torch.testing.assert_close(total.double(), expected_total.reshape(1), rtol=1e-6, atol=0)
    if per_tensor:
        expected = torch.stack([torch.linalg.vector_norm(t.double() * inv64) for t in tensors])
        torch.testing.assert_close(per.double(), expected, rtol=1e-6, atol=0)
    else:
        assert per.numel() == 0


# --- scale ---------------------------------------------------------------------------------------

# A float32 value: the product of a float32 (or narrower) input with it is exact in float64, so
# ``(x.double() * SCALE)`` rounded once is float32 arithmetic rounded once.
SCALE = float(torch.tensor(0.3, dtype=torch.float32))


def scaled_reference(x, out_dtype):
    """x * SCALE computed in float32 (exact product, one rounding), then cast to out_dtype."""
    return (x.double() * SCALE).float().to(out_dtype)


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_scale_out_of_place(in_dtype, out_dtype):
    sources = randn_list(in_dtype, scale=5.0)
    keep = [s.clone() for s in sources]
    outputs = [torch.full(s.shape, float("nan"), dtype=out_dtype) for s in sources]
    flag = noop_flag()
    multi_tensor_applier(multi_tensor_scale, flag, [sources, outputs], SCALE)
    for src, kept, out in zip(sources, keep, outputs):
        assert out.dtype == out_dtype
        assert torch.equal(out, scaled_reference(kept, out_dtype))
        assert torch.equal(src, kept), "the inputs must not change"
    assert flag.item() == 0


def test_scale_bf16_into_fp32_is_the_exact_product():
    # A power-of-two scale: the product of a bfloat16 with it is exactly representable in float32.
    sources = randn_list(torch.bfloat16)
    outputs = [torch.empty(s.shape, dtype=torch.float32) for s in sources]
    multi_tensor_applier(multi_tensor_scale, noop_flag(), [sources, outputs], 2.0**-7)
    for src, out in zip(sources, outputs):
        assert torch.equal(out.double(), src.double() * 2.0**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_in_place(dtype):
    # Regression: torch's CPU _foreach_mul_ on 16-bit tensors rounds the scale to their dtype
    # first (a bfloat16 100 times 1/3 gave 33.5, not 33.25).
    tensors = randn_list(dtype, scale=5.0)
    expected = [scaled_reference(t, dtype) for t in tensors]
    flag = noop_flag()
    multi_tensor_applier(multi_tensor_scale, flag, [tensors, tensors], SCALE)
    for t, e in zip(tensors, expected):
        assert torch.equal(t, e)
    assert flag.item() == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_sets_flag_on_nonfinite(bad, dtype):
    sources = randn_list(dtype)
    sources[2].view(-1)[5] = bad
    outputs = [torch.empty(s.shape, dtype=torch.float32) for s in sources]
    flag = noop_flag()
    multi_tensor_applier(multi_tensor_scale, flag, [sources, outputs], 0.5)
    assert flag.item() == 1
    # The finite tensors are still scaled.
    assert torch.equal(outputs[0].double(), sources[0].double() * 0.5)


def test_scale_leaves_a_set_flag_set():
    sources = randn_list()
    outputs = [torch.empty_like(s) for s in sources]
    flag = torch.ones(1, dtype=torch.int)
    multi_tensor_applier(multi_tensor_scale, flag, [sources, outputs], 2.0)
    assert flag.item() == 1


def test_scale_finite_large_values_do_not_set_flag():
    sources = [torch.tensor([3.0e38, -3.0e38]), torch.tensor([1.0])]
    outputs = [torch.empty(2), torch.empty(1)]
    flag = noop_flag()
    multi_tensor_applier(multi_tensor_scale, flag, [sources, outputs], 0.5)
    assert flag.item() == 0
    assert torch.equal(outputs[0].double(), sources[0].double() * 0.5)


# --- compute_scale_and_scale_inv -----------------------------------------------------------------

FLT_MAX = torch.finfo(torch.float32).max


def scale_reference(amax, max_fp8, force_pow_2, epsilon):
    """Upstream's current-scaling formula written out in float64, rounded once to float32."""
    a = max(amax, epsilon)
    if math.isnan(a) or math.isinf(a) or a == 0.0:
        scale = 1.0
    else:
        scale = float(torch.tensor(max_fp8 / a, dtype=torch.float64).float())
        if math.isinf(scale):
            scale = FLT_MAX
    if force_pow_2:
        mantissa, exponent = math.frexp(scale)
        scale = 2.0 ** (exponent - 1)
    return scale


def run_compute_scale(amaxes, max_fp8, force_pow_2=False, epsilon=0.0):
    amax_t = [torch.tensor([a], dtype=torch.float32) for a in amaxes]
    scales = [torch.full((1,), -7.0) for _ in amaxes]
    scale_invs = [torch.full((1,), -7.0) for _ in amaxes]
    multi_tensor_applier(
        multi_tensor_compute_scale_and_scale_inv,
        noop_flag(),
        [amax_t, scales, scale_invs],
        max_fp8,
        force_pow_2,
        epsilon,
    )
    return [s.item() for s in scales], [s.item() for s in scale_invs]


@pytest.mark.parametrize("max_fp8", [448.0, 57344.0])
@pytest.mark.parametrize("force_pow_2", [False, True])
def test_compute_scale_and_scale_inv(max_fp8, force_pow_2):
    amaxes = [0.0, 1.0, 3.0, 0.1, 1000.0, 2.5e-3, 448.0, 7.0, 1e-40, float("inf")]
    amaxes = [float(torch.tensor(a, dtype=torch.float32)) for a in amaxes]
    scales, scale_invs = run_compute_scale(amaxes, max_fp8, force_pow_2)
    for amax, scale, scale_inv in zip(amaxes, scales, scale_invs):
        expected = scale_reference(amax, max_fp8, force_pow_2, 0.0)
        # max_fp8 / amax correctly rounded (an ulp of slack here; the exact test is below).
        assert scale == pytest.approx(expected, rel=2**-23, abs=0), amax
        assert scale_inv == pytest.approx(1.0 / scale, rel=2**-23, abs=0), amax
    assert scales[0] == 1.0 and scale_invs[0] == 1.0, "amax 0 gives scale 1"
    assert scales[-1] == 1.0 and scale_invs[-1] == 1.0, "an infinite amax gives scale 1"
    assert scales[8] == (2.0**127 if force_pow_2 else FLT_MAX), "Inf scale becomes FLT_MAX"
    if force_pow_2:
        for scale in scales:
            assert math.frexp(scale)[0] == 0.5, "a power of two"


def test_compute_scale_epsilon():
    scales, scale_invs = run_compute_scale([0.0, 1e-6, 2.0], 448.0, epsilon=0.5)
    assert scales[0] == 896.0 and scales[1] == 896.0, "amax below epsilon is raised to it"
    assert scales[2] == 224.0
    f32 = [float(torch.tensor(1.0 / s, dtype=torch.float32)) for s in (896.0, 896.0, 224.0)]
    assert scale_invs == f32


def test_compute_scale_force_pow_2_rounds_down():
    scales, _ = run_compute_scale([3.0, 0.3, 448.0, 1.0], 448.0, force_pow_2=True)
    # 149.33 -> 128, 1493.3 -> 1024, 1 -> 1, 448 -> 256
    assert scales == [128.0, 1024.0, 1.0, 256.0]


def test_compute_scale_is_correctly_rounded():
    # Regression: `float / tensor` is reciprocal(tensor) * float in torch, two roundings (a
    # quarter of these scales were one ulp off the correctly rounded max_fp8 / amax).
    amaxes = [float(a) for a in torch.rand(200) * 100 + 1e-3]
    scales, _ = run_compute_scale(amaxes, 448.0)
    expected = [scale_reference(a, 448.0, False, 0.0) for a in amaxes]
    assert scales == expected


# --- Adam ----------------------------------------------------------------------------------------


def adam_reference(p, g, m, v, *, lr, beta1, beta2, eps, step, mode, bias_correction, wd):
    """One Adam step in float64 (mode 0: L2 added to the gradient, mode 1: AdamW)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    if mode == 0:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


ADAM = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, step=3, wd=0.05)


def adam_inputs(param_dtype=torch.float32, moment_dtype=torch.float32):
    grads = randn_list(torch.float32)
    params = randn_list(param_dtype)
    exp_avgs = randn_list(moment_dtype, scale=0.1)
    exp_avg_sqs = [t.abs().to(moment_dtype) for t in randn_list(torch.float32, scale=0.1)]
    return grads, params, exp_avgs, exp_avg_sqs


def call_adam(op, lists, mode, bias_correction):
    a = ADAM
    args = (a["lr"], a["beta1"], a["beta2"], a["eps"], a["step"], mode, bias_correction, a["wd"])
    multi_tensor_applier(op, noop_flag(), lists, *args)


def expected_adam(lists, mode, bias_correction):
    a = ADAM
    kw = dict(lr=a["lr"], beta1=a["beta1"], beta2=a["beta2"], eps=a["eps"], step=a["step"],
              mode=mode, bias_correction=bias_correction, wd=a["wd"])  # fmt: skip
    return [adam_reference(p, g, m, v, **kw) for g, p, m, v in zip(*lists)]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_four_lists_float32(mode, bias_correction):
    lists = adam_inputs()
    grads_before = [g.clone() for g in lists[0]]
    expected = expected_adam(lists, mode, bias_correction)
    call_adam(multi_tensor_adam, lists, mode, bias_correction)
    for (p_ref, m_ref, v_ref), p, m, v in zip(expected, *lists[1:]):
        torch.testing.assert_close(m.double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(p.double(), p_ref, rtol=1e-6, atol=1e-6)
    for g, g0 in zip(lists[0], grads_before):
        assert torch.equal(g, g0), "the gradients are only read"


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_adam_five_lists_master(param_dtype):
    grads, _, exp_avgs, exp_avg_sqs = adam_inputs()
    masters = randn_list(torch.float32)
    params = [m.to(param_dtype) for m in masters]
    lists = [grads, params, exp_avgs, exp_avg_sqs, masters]
    expected = expected_adam([grads, masters, exp_avgs, exp_avg_sqs], 1, True)
    call_adam(multi_tensor_adam, lists, 1, True)
    for (p_ref, m_ref, v_ref), p, m, v, master in zip(expected, *lists[1:]):
        torch.testing.assert_close(master.double(), p_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-6, atol=1e-8)
        assert p.dtype == param_dtype
        assert torch.equal(p, master.to(param_dtype)), "the param is the master rounded"


def test_adam_low_precision_tensors_rounded_once():
    """bfloat16 params and moments: computed in float32 from their values, rounded once."""
    lists = adam_inputs(torch.bfloat16, torch.bfloat16)
    expected = expected_adam(lists, 1, True)
    call_adam(multi_tensor_adam, lists, 1, True)
    eps = torch.finfo(torch.bfloat16).eps
    for (p_ref, m_ref, v_ref), p, m, v in zip(expected, *lists[1:]):
        assert p.dtype == m.dtype == v.dtype == torch.bfloat16
        for got, ref in ((p, p_ref), (m, m_ref), (v, v_ref)):
            assert ((got.double() - ref).abs() <= eps * ref.abs() + 1e-30).all()


# The param-remainder form, with the test's own (unsigned) split and join of float32 bits.


def split_by_hand(master):
    """(bfloat16 rounded to nearest with ties away from zero, int16 low half) of float32s."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = ((bits >> 16) + (low >= 0x8000).to(torch.int64)) & 0xFFFF
    high_signed = torch.where(high >= 0x8000, high - 0x10000, high)
    low_signed = torch.where(low >= 0x8000, low - 0x10000, low)
    return high_signed.to(torch.int16).view(torch.bfloat16), low_signed.to(torch.int16)


def join_by_hand(param, remainder):
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (high - (low >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = (high << 16) | low
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def test_split_by_hand_is_round_to_nearest():
    """The test's own split agrees with torch's rounding away from exact ties."""
    x = torch.randn(4096)
    p, r = split_by_hand(x)
    assert torch.equal(join_by_hand(p, r), x)
    assert torch.equal(p, x.bfloat16())


@pytest.mark.parametrize("mode", [0, 1])
def test_adam_param_remainder(mode):
    grads, _, exp_avgs, exp_avg_sqs = adam_inputs()
    masters = randn_list(torch.float32)
    pairs = [split_by_hand(m) for m in masters]
    params = [p for p, _ in pairs]
    remainders = [r for _, r in pairs]
    expected = expected_adam([grads, masters, exp_avgs, exp_avg_sqs], mode, True)
    lists = [grads, params, exp_avgs, exp_avg_sqs, remainders]
    call_adam(multi_tensor_adam_param_remainder, lists, mode, True)
    for (p_ref, m_ref, v_ref), p, m, v, r in zip(expected, *lists[1:]):
        assert p.dtype == torch.bfloat16 and r.dtype == torch.int16
        master = join_by_hand(p, r)
        torch.testing.assert_close(master.double(), p_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-6, atol=1e-8)
        p_hand, r_hand = split_by_hand(master)
        assert torch.equal(p, p_hand) and torch.equal(r, r_hand)


def test_adam_param_remainder_rounds_ties_away_from_zero():
    # Masters exactly halfway between two bfloat16s, which a zero step leaves unchanged.
    # 1 + 2**-8 lies between 1.0 and 1.0078125, 3 + 2**-7 between 3.0 and 3.015625; ties to
    # even would give 1.0 and 3.0 (even mantissas), ties away from zero the larger magnitudes.
    masters = [torch.tensor([1.0 + 2.0**-8, -(1.0 + 2.0**-8), 3.0 + 2.0**-7])]
    rounded = [1.0078125, -1.0078125, 3.015625]
    params = [torch.tensor(rounded, dtype=torch.bfloat16)]
    remainders = [torch.full((3,), -32768, dtype=torch.int16)]  # low half 0x8000
    assert torch.equal(join_by_hand(params[0], remainders[0]), masters[0])
    zeros = [torch.zeros(3)]
    lists = [zeros, params, [torch.zeros(3)], [torch.zeros(3)], remainders]
    multi_tensor_applier(
        multi_tensor_adam_param_remainder, noop_flag(), lists, 0.0, 0.9, 0.999, 1e-8, 1, 1, True, 0
    )
    assert params[0].tolist() == rounded
    assert remainders[0].tolist() == [-32768] * 3


def capturable_args(lr=0.01, step=3, inv_scale=0.25):
    return dict(
        lr=torch.tensor([lr]), beta1=0.9, beta2=0.99, eps=1e-8, step=torch.tensor([float(step)]),
        mode=1, bias_correction=True, wd=0.05, inv_scale=torch.tensor([inv_scale]),
    )  # fmt: skip


def call_capturable(op, flag, lists, a):
    multi_tensor_applier(op, flag, lists, a["lr"], a["beta1"], a["beta2"], a["eps"], a["step"],
                         a["mode"], a["bias_correction"], a["wd"], a["inv_scale"])  # fmt: skip


def test_adam_capturable_scales_gradients():
    lists = adam_inputs()
    a = capturable_args()
    scaled = [g * 4.0 for g in lists[0]]  # inv_scale 0.25 undoes it exactly
    expected = expected_adam(lists, 1, True)
    call_capturable(multi_tensor_adam_capturable, noop_flag(), [scaled, *lists[1:]], a)
    for (p_ref, m_ref, v_ref), p, m, v in zip(expected, *lists[1:]):
        # The bias corrections are computed in float32 from a float32 step: a looser rtol.
        torch.testing.assert_close(p.double(), p_ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(m.double(), m_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable_noop_flag_changes_nothing(master):
    grads, params, exp_avgs, exp_avg_sqs = adam_inputs()
    lists = [grads, params, exp_avgs, exp_avg_sqs]
    op = multi_tensor_adam_capturable
    if master:
        lists = [grads, [p.bfloat16() for p in params], exp_avgs, exp_avg_sqs, params]
        op = multi_tensor_adam_capturable_master
    before = [[t.clone() for t in lst] for lst in lists]
    call_capturable(op, torch.ones(1, dtype=torch.int), lists, capturable_args())
    for lst, lst0 in zip(lists, before):
        for t, t0 in zip(lst, lst0):
            assert torch.equal(t, t0)


def test_adam_capturable_master_updates_master_and_param():
    grads, masters, exp_avgs, exp_avg_sqs = adam_inputs()
    params = [m.bfloat16() for m in masters]
    expected = expected_adam([grads, masters, exp_avgs, exp_avg_sqs], 1, True)
    lists = [[g * 4.0 for g in grads], params, exp_avgs, exp_avg_sqs, masters]
    call_capturable(multi_tensor_adam_capturable_master, noop_flag(), lists, capturable_args())
    for (p_ref, _, _), p, master in zip(expected, params, masters):
        torch.testing.assert_close(master.double(), p_ref, rtol=2e-6, atol=2e-6)
        assert torch.equal(p, master.bfloat16())


# --- SGD -----------------------------------------------------------------------------------------


def sgd_reference(p, g, buf, *, wd, momentum, dampening, lr, nesterov, first_run, wd_after,
                  scale=1.0):  # fmt: skip
    p, g = p.double(), g.double() * scale
    if wd and not wd_after:
        g = g + wd * p
    if momentum:
        buf = g.clone() if first_run else momentum * buf.double() + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if wd and wd_after:
        g = g + wd * p
    return p - lr * g, buf


SGD_CASES = [
    dict(wd=0.0, momentum=0.0, dampening=0.0, nesterov=False, first_run=False, wd_after=False),
    dict(wd=0.1, momentum=0.9, dampening=0.0, nesterov=False, first_run=True, wd_after=False),
    dict(wd=0.1, momentum=0.9, dampening=0.2, nesterov=False, first_run=False, wd_after=False),
    dict(wd=0.1, momentum=0.9, dampening=0.0, nesterov=True, first_run=False, wd_after=False),
    dict(wd=0.1, momentum=0.9, dampening=0.3, nesterov=False, first_run=False, wd_after=True),
    dict(wd=0.1, momentum=0.0, dampening=0.0, nesterov=False, first_run=False, wd_after=True),
]


@pytest.mark.parametrize("case", SGD_CASES, ids=range(len(SGD_CASES)))
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_sgd_matches_formula(case, scale):
    grads, params, bufs = randn_list(), randn_list(), randn_list()
    lr = 0.05
    expected = [sgd_reference(p, g, b, lr=lr, scale=scale, **case)
                for g, p, b in zip(grads, params, bufs)]  # fmt: skip
    bufs_before = [b.clone() for b in bufs]
    multi_tensor_applier(
        multi_tensor_sgd, noop_flag(), [grads, params, bufs], case["wd"], case["momentum"],
        case["dampening"], lr, case["nesterov"], case["first_run"], case["wd_after"], scale,
    )  # fmt: skip
    for (p_ref, b_ref), p, b, b0 in zip(expected, params, bufs, bufs_before):
        torch.testing.assert_close(p.double(), p_ref, rtol=1e-6, atol=1e-6)
        if case["momentum"]:
            torch.testing.assert_close(b.double(), b_ref, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(b, b0), "no momentum: the buffers are not touched"


def test_sgd_fourth_list_receives_params():
    grads, params, bufs = randn_list(), randn_list(), randn_list()
    copies = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    expected = [sgd_reference(p, g, b, wd=0.0, momentum=0.9, dampening=0.0, lr=0.1,
                              nesterov=False, first_run=False, wd_after=False)[0]
                for g, p, b in zip(grads, params, bufs)]  # fmt: skip
    multi_tensor_applier(multi_tensor_sgd, noop_flag(), [grads, params, bufs, copies], 0.0, 0.9,
                         0.0, 0.1, False, False, False, 1.0)  # fmt: skip
    for p_ref, p, c in zip(expected, params, copies):
        torch.testing.assert_close(p.double(), p_ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(c, p.bfloat16())


# --- the applier ---------------------------------------------------------------------------------


def test_applier_drops_empty_slots():
    tensors = [torch.tensor([3.0, 4.0]), torch.empty(0), torch.tensor([1.0])]
    total, per = multi_tensor_applier(multi_tensor_l2norm, noop_flag(), [tensors], True)
    assert per.tolist() == [5.0, 1.0]
    assert total.item() == pytest.approx(math.sqrt(26.0), rel=1e-7)
    outputs = [torch.zeros(2), torch.empty(0), torch.zeros(1)]
    multi_tensor_applier(multi_tensor_scale, noop_flag(), [tensors, outputs], 2.0)
    assert outputs[0].tolist() == [6.0, 8.0] and outputs[2].tolist() == [2.0]


def test_applier_returns_none_for_nothing():
    calls = []

    def op(*args):
        calls.append(args)
        return "called"

    assert multi_tensor_applier(op, noop_flag(), []) is None
    assert multi_tensor_applier(op, noop_flag(), [[], []]) is None
    assert multi_tensor_applier(op, noop_flag(), [[torch.empty(0)], [torch.empty(0)]]) is None
    assert calls == []
    assert multi_tensor_applier(op, noop_flag(), [[torch.ones(1)]], 5) == "called"
    assert calls[0][0] == multi_tensor_applier.chunk_size and calls[0][3] == 5


def test_applier_rejects_unequal_lists():
    with pytest.raises(ValueError):
        multi_tensor_applier(
            multi_tensor_scale, noop_flag(), [[torch.ones(2)], [torch.ones(2), torch.ones(2)]], 1.0
        )


def test_ops_reject_wrong_list_count():
    with pytest.raises(ValueError):
        multi_tensor_scale(0, noop_flag(), [[torch.ones(2)]], 1.0)
    with pytest.raises(ValueError):
        multi_tensor_adam(0, noop_flag(), [[torch.ones(2)]] * 3, 0.1, 0.9, 0.99, 1e-8, 1, 1, 1, 0)


def test_bf16_remainder_split_covers_every_low_half():
    """Every low half under a few upper halves (signs, the largest finite, subnormals): the
    pair joins back to the same bits, and the bfloat16 is the float32 rounded to nearest with
    ties away from zero (the upper half, plus one when the low half is 0x8000 or more)."""
    from transformer_engine.pytorch.optimizers._adam_math import (
        join_bf16_remainder,
        split_bf16_remainder,
    )

    uppers = torch.tensor([0x0000, 0x0001, 0x3F80, 0x7F7F, 0x8001, 0xBF80, 0xFF7F])
    bits = ((uppers[:, None] << 16) | torch.arange(65536)[None, :]).reshape(-1)
    bits32 = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    param, remainder = split_bf16_remainder(bits32.view(torch.float32))
    assert torch.equal(join_bf16_remainder(param, remainder).view(torch.int32), bits32)
    expected = ((bits >> 16) + ((bits & 0xFFFF) >= 0x8000).long()) & 0xFFFF
    assert torch.equal(param.view(torch.int16).long() & 0xFFFF, expected)
