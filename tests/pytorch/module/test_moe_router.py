"""MoE routing (``transformer_engine.pytorch.router``) against a per-token float64 oracle.

The oracle chooses each token's experts with plain Python sorting (score descending, lower
index first) and gives the gradients from hand-derived formulas, so it shares no code with
the vectorized implementation.
"""

import math

import pytest
import torch

from transformer_engine.pytorch.router import (
    fused_compute_score_for_moe_aux_loss,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _distinct_logits(tokens, experts, dtype, seed=0):
    """Logits whose scores are far apart (no near-ties to break differently in float32 and
    float64), exactly representable in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g) for _ in range(tokens)]
    base = torch.stack(rows).to(torch.float64) * 0.25 - experts * 0.125
    return base.to(dtype)


def _order(values, allowed=None):
    idx = range(len(values)) if allowed is None else allowed
    return sorted(idx, key=lambda i: (-values[i], i))


def _oracle_choice(steer, topk, grouping):
    """Chosen expert indices of one token (a list of floats)."""
    if grouping is None:
        return _order(steer)[:topk]
    num_groups, group_topk = grouping
    size = len(steer) // num_groups
    per_group = topk // group_topk
    sums = []
    for g in range(num_groups):
        members = steer[g * size : (g + 1) * size]
        sums.append(sum(sorted(members, reverse=True)[:per_group]))
    groups = _order(sums)[:group_topk]
    allowed = [g * size + j for g in groups for j in range(size)]
    return _order(steer, allowed)[:topk]


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _oracle_topk(z, w, topk, pre, grouping, scale, score_function, bias):
    """One token: ``(probs, chosen, d(sum w * probs)/dz)`` in float64 lists."""
    n = len(z)
    s = scale if scale else 1.0
    probs, grad = [0.0] * n, [0.0] * n
    if score_function == "softmax":
        if pre:
            m = max(z)
            e = [math.exp(v - m) for v in z]
            P = [v / sum(e) for v in e]
            chosen = _oracle_choice(P, topk, grouping)
            for j in chosen:
                probs[j] = s * P[j]
            dot = sum(w[j] * P[j] for j in chosen)
            for k in range(n):
                grad[k] = s * ((w[k] * P[k] if k in chosen else 0.0) - P[k] * dot)
        else:
            chosen = _oracle_choice(z, topk, grouping)
            m = max(z[j] for j in chosen)
            e = {j: math.exp(z[j] - m) for j in chosen}
            tot = sum(e.values())
            p = {j: e[j] / tot for j in chosen}
            dot = sum(w[j] * p[j] for j in chosen)
            for j in chosen:
                probs[j] = s * p[j]
                grad[j] = s * p[j] * (w[j] - dot)
    else:
        q = [_sigmoid(v) for v in z]
        steer = q if bias is None else [q[i] + bias[i] for i in range(n)]
        chosen = _oracle_choice(steer, topk, grouping)
        if topk > 1:
            Q = sum(q[j] for j in chosen) + 1e-20
            dot = sum(w[j] * q[j] for j in chosen)
            for j in chosen:
                probs[j] = s * q[j] / Q
                grad[j] = s * (w[j] / Q - dot / Q**2) * q[j] * (1 - q[j])
        else:
            (j,) = chosen
            probs[j] = s * q[j]
            grad[j] = s * w[j] * q[j] * (1 - q[j])
    return probs, chosen, grad


CASES = [
    # topk, use_pre_softmax, grouping, scaling_factor, score_function, with_bias
    (1, False, None, None, "softmax", False),
    (2, False, None, None, "softmax", False),
    (4, True, None, 2.5, "softmax", False),
    (4, False, (4, 2), None, "softmax", False),
    (6, True, (4, 3), 1.5, "softmax", False),
    (1, False, None, None, "sigmoid", False),
    (2, False, None, 2.0, "sigmoid", False),
    (4, False, None, None, "sigmoid", True),
    (8, False, (8, 4), 2.5, "sigmoid", True),
    (4, False, (4, 2), None, "sigmoid", False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_topk_with_score_function_matches_oracle(case, dtype, device):
    topk, pre, grouping, scale, score_function, with_bias = case
    tokens, experts = 7, 16
    logits = _distinct_logits(tokens, experts, dtype).to(device).requires_grad_()
    bias = None
    if with_bias:
        bias = (torch.arange(experts, dtype=torch.float32).flip(0) * 0.05).to(device)
        bias.requires_grad_()
    w = torch.randn(
        tokens, experts, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    num_groups, group_topk = grouping if grouping else (None, None)
    probs, routing_map = fused_topk_with_score_function(
        logits, topk, pre, num_groups, group_topk, scale, score_function, bias
    )
    (probs.float() * w.to(device, torch.float32)).sum().backward()

    assert probs.dtype == dtype and probs.shape == logits.shape
    assert routing_map.dtype == torch.bool and routing_map.shape == logits.shape
    z = logits.detach().double().cpu()
    b = None if bias is None else bias.detach().double().cpu().tolist()
    w = w.to(dtype).double()  # the gradient reaching probs is in probs' dtype
    want_probs, want_grad = torch.zeros(tokens, experts, dtype=torch.float64), []
    want_map = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        p, chosen, g = _oracle_topk(
            z[t].tolist(), w[t].tolist(), topk, pre, grouping, scale, score_function, b
        )
        want_probs[t] = torch.tensor(p, dtype=torch.float64)
        want_map[t, chosen] = True
        want_grad.append(g)
    assert torch.equal(routing_map.cpu(), want_map)
    # Computed in float32, rounded once to the output dtype.
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(probs.double().cpu(), want_probs, **tol)
    torch.testing.assert_close(
        logits.grad.double().cpu(), torch.tensor(want_grad, dtype=torch.float64),
        **(dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)),
    )  # fmt: skip
    if bias is not None:
        assert bias.grad is None  # the bias steers the choice only


def test_group_limited_routing_keeps_to_the_chosen_groups():
    # Group 1 holds the single best expert, but group 0's best two sum higher: with
    # group_topk=1 only group 0 competes.
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 4.0, -5.0, -5.0, -5.0]])
    _, routing_map = fused_topk_with_score_function(logits, 2, False, 2, 1, None, "softmax", None)
    assert routing_map[0].nonzero().flatten().tolist() == [0, 1]
    _, ungrouped = fused_topk_with_score_function(
        logits, 2, False, None, None, None, "softmax", None
    )
    assert ungrouped[0].nonzero().flatten().tolist() == [0, 4]


def test_bias_changes_the_choice_not_the_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    probs, routing_map = fused_topk_with_score_function(
        logits, 2, False, None, None, None, "sigmoid", bias
    )
    assert routing_map[0].tolist() == [True, False, False, True]
    q0, q3 = _sigmoid(2.0), _sigmoid(-1.0)
    want = torch.tensor([q0 / (q0 + q3), 0.0, 0.0, q3 / (q0 + q3)], dtype=torch.float64)
    torch.testing.assert_close(probs[0].double(), want, rtol=1e-6, atol=0)


def test_ties_go_to_the_lower_index():
    logits = torch.zeros(3, 8)
    probs, routing_map = fused_topk_with_score_function(
        logits, 3, True, None, None, None, "softmax", None
    )
    assert routing_map.nonzero()[:, 1].reshape(3, 3).tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(probs[:, :3], torch.full((3, 3), 1 / 8))


def test_leading_dimensions_are_kept():
    logits = _distinct_logits(12, 8, torch.float32).reshape(3, 4, 8)
    probs, routing_map = fused_topk_with_score_function(
        logits, 2, False, None, None, None, "softmax", None
    )
    flat_probs, flat_map = fused_topk_with_score_function(
        logits.reshape(12, 8), 2, False, None, None, None, "softmax", None
    )
    assert probs.shape == routing_map.shape == (3, 4, 8)
    assert torch.equal(probs.reshape(12, 8), flat_probs) and torch.equal(
        routing_map.reshape(12, 8), flat_map
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(topk=0), ValueError, "topk"),
        (dict(topk=9), ValueError, "topk"),
        (dict(score_function="sqrt"), ValueError, "score_function"),
        (dict(num_groups=3, group_topk=1), ValueError, "divide"),
        (dict(num_groups=4, group_topk=None), ValueError, "both"),
        (dict(topk=3, num_groups=4, group_topk=2), ValueError, "divide topk"),
        (dict(topk=6, num_groups=4, group_topk=2), ValueError, "a group has 2"),
        (dict(expert_bias=torch.zeros(8)), ValueError, "sigmoid"),
        (dict(score_function="sigmoid", expert_bias=torch.zeros(7)), ValueError, r"\[8\]"),
        (dict(logits=torch.zeros(2, 8, dtype=torch.int64)), TypeError, "floating point"),
        (dict(logits=torch.zeros(2, 8, device="meta")), ValueError, "meta"),
    ],
)
def test_topk_errors_name_the_value(kwargs, error, match):
    args = dict(logits=torch.zeros(2, 8), topk=2, use_pre_softmax=False, num_groups=None,
                group_topk=None, scaling_factor=None, score_function="softmax", expert_bias=None)  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=match):
        fused_topk_with_score_function(**args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_function, topk", [("softmax", 2), ("sigmoid", 1), ("sigmoid", 3)])
def test_scores_for_aux_loss_match_oracle(score_function, topk, device):
    tokens, experts = 5, 12
    logits = _distinct_logits(tokens, experts, torch.float32, seed=3).to(device).requires_grad_()
    w = torch.randn(
        tokens, experts, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    routing_map, scores = fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
    (scores * w.to(device, torch.float32)).sum().backward()
    assert scores.dtype == torch.float32 and routing_map.dtype == torch.bool
    z = logits.detach().double().cpu()
    for t in range(tokens):
        zt, wt = z[t].tolist(), w[t].tolist()
        if score_function == "softmax":
            m = max(zt)
            e = [math.exp(v - m) for v in zt]
            s = [v / sum(e) for v in e]
            dot = sum(a * b for a, b in zip(wt, s))
            g = [s[k] * (wt[k] - dot) for k in range(experts)]
        else:
            q = [_sigmoid(v) for v in zt]
            if topk > 1:
                Q = sum(q) + 1e-20
                s = [v / Q for v in q]
                dot = sum(a * b for a, b in zip(wt, q))
                g = [(wt[k] / Q - dot / Q**2) * q[k] * (1 - q[k]) for k in range(experts)]
            else:
                s = q
                g = [wt[k] * q[k] * (1 - q[k]) for k in range(experts)]
        torch.testing.assert_close(
            scores[t].double().cpu(), torch.tensor(s, dtype=torch.float64), rtol=1e-6, atol=1e-8
        )
        torch.testing.assert_close(
            logits.grad[t].double().cpu(),
            torch.tensor(g, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-8,
        )
        assert routing_map[t].nonzero().flatten().tolist() == sorted(_order(s)[:topk])


def test_sigmoid_scores_for_aux_loss_keep_the_logits_dtype():
    logits = _distinct_logits(4, 8, torch.bfloat16)
    _, scores = fused_compute_score_for_moe_aux_loss(logits, 2, "sigmoid")
    assert scores.dtype == torch.bfloat16
    _, softmax_scores = fused_compute_score_for_moe_aux_loss(logits, 2, "softmax")
    assert softmax_scores.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("total", [40, "tensor"])
def test_aux_loss_matches_formula(total, device):
    tokens, experts, topk, coeff = 10, 6, 2, 1e-2
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(tokens, experts, generator=g, dtype=torch.float64).to(device)
    probs32 = probs.float().requires_grad_()
    counts = torch.randint(0, 9, (experts,), generator=g, dtype=torch.int32).to(device)
    total_value = 40
    total_arg = torch.tensor(total_value, device=device) if total == "tensor" else total_value
    loss = fused_moe_aux_loss(probs32, counts, total_arg, experts, topk, coeff)
    loss.backward()
    scale = experts * coeff / (topk * total_value**2)
    p, c = probs.cpu().tolist(), counts.cpu().tolist()
    want = sum(p[t][e] * c[e] for t in range(tokens) for e in range(experts)) * scale
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert math.isclose(loss.item(), want, rel_tol=1e-6)
    want_grad = torch.tensor([[c[e] * scale for e in range(experts)]] * tokens, dtype=torch.float64)
    torch.testing.assert_close(probs32.grad.double().cpu(), want_grad, rtol=1e-6, atol=0)


def test_aux_loss_over_sequence_columns():
    # Megatron-LM's per-sequence loss: probs [sequence, batch * experts], one count per column;
    # num_experts only scales the sum.
    seq, batch, experts, topk, coeff = 5, 3, 4, 2, 0.1
    g = torch.Generator().manual_seed(6)
    probs = torch.rand(seq, batch * experts, generator=g, dtype=torch.float64)
    counts = torch.randint(0, 7, (batch * experts,), generator=g)
    loss = fused_moe_aux_loss(probs, counts, seq, experts, topk, coeff)
    want = (probs * counts).sum().item() * experts * coeff / (topk * seq * seq)
    assert loss.dtype == torch.float64 and math.isclose(loss.item(), want, rel_tol=1e-12)


def test_aux_loss_errors():
    probs = torch.rand(4, 6)
    with pytest.raises(ValueError, match="2-D"):
        fused_moe_aux_loss(probs.reshape(4, 2, 3), torch.ones(3), 4, 3, 2, 0.1)
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[6\]"):
        fused_moe_aux_loss(probs, torch.ones(5), 4, 6, 2, 0.1)
    with pytest.raises(TypeError, match="floating-point"):
        fused_moe_aux_loss(torch.ones(4, 6, dtype=torch.int32), torch.ones(6), 4, 6, 2, 0.1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device_while_first_is_current():
    torch.cuda.set_device(0)
    logits = _distinct_logits(6, 16, torch.bfloat16).to("cuda:1").requires_grad_()
    probs, routing_map = fused_topk_with_score_function(
        logits, 4, False, 4, 2, None, "sigmoid", None
    )
    probs.float().sum().backward()
    assert probs.device == routing_map.device == logits.grad.device == torch.device("cuda:1")
    cpu_probs, cpu_map = fused_topk_with_score_function(
        logits.detach().cpu(), 4, False, 4, 2, None, "sigmoid", None
    )
    assert torch.equal(routing_map.cpu(), cpu_map)
    torch.testing.assert_close(probs.cpu(), cpu_probs)
