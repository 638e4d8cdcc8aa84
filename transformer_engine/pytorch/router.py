"""Mixture-of-experts routing (upstream's ``transformer_engine.pytorch.router``).

Three functions that Megatron-LM calls when its router fusion is on, with the meaning of the
unfused router they replace:

- :func:`fused_topk_with_score_function`: each token's ``topk`` experts and their routing
  probabilities, from its logits through a softmax or a sigmoid score (optionally limited to
  the best groups of experts, with a per-expert bias that steers the choice but not the
  probabilities), returned dense: ``(probs, routing_map)``, both shaped like the logits.
- :func:`fused_compute_score_for_moe_aux_loss`: the scores and top-k map the load-balancing
  loss is computed from.
- :func:`fused_moe_aux_loss`: that loss (Switch Transformer's), from the scores and the tokens
  each expert received.

The scores are computed in float32 (float64 for float64 logits) and rounded once to the
output's dtype; the choice is made on those unrounded scores, and among equal scores the expert
with the lower index wins. Everything is composed of differentiable PyTorch operations on the
logits' device, so autograd gives the gradients (to the logits; the bias only steers the
choice and gets none).
"""

from __future__ import annotations

import torch

__all__ = [
    "fused_topk_with_score_function",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")

# Added to the sum of a token's sigmoid scores before dividing by it, as the unfused router does
# (so an all-zero row gives zeros, not NaN).
_SIGMOID_NORM_EPSILON = 1e-20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_logits(name: str, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name}: logits must be a tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            f"{name}: logits must be floating point (float32, bfloat16, float16), got "
            f"{logits.dtype}"
        )
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name}: logits must be [..., num_experts] with num_experts > 0, got shape "
            f"{tuple(logits.shape)}"
        )
    if logits.is_meta:
        raise ValueError(f"{name}: logits are on the meta device; routing needs their values")


def _check_score_function(name: str, score_function: str) -> None:
    if score_function not in _SCORE_FUNCTIONS:
        raise ValueError(
            f"{name}: score_function must be 'softmax' or 'sigmoid', got {score_function!r}"
        )


def _check_topk(name: str, topk, num_experts: int) -> int:
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"{name}: topk must be an int in [1, {num_experts}] (the number of "
                         f"experts), got {topk!r}")  # fmt: skip
    return topk


def _checked_rows(name: str, logits, topk, score_function: str):
    """``(logits as [tokens, num_experts] in the compute dtype, topk)`` after the checks the
    routing functions share."""
    _check_logits(name, logits)
    _check_score_function(name, score_function)
    num_experts = logits.shape[-1]
    topk = _check_topk(name, topk, num_experts)
    return logits.reshape(-1, num_experts).to(_compute_dtype(logits.dtype)), topk


def _grouping(name: str, num_groups, group_topk, topk: int, num_experts: int):
    """``(num_groups, group_topk)`` of group-limited routing, or ``None`` when it is off
    (``None``, 0 or -1 for either, as callers pass "not used")."""
    off = (None, 0, -1)
    if num_groups in off and group_topk in off:
        return None
    if num_groups in off or group_topk in off:
        raise ValueError(
            f"{name}: group-limited routing needs both num_groups and group_topk, got "
            f"num_groups={num_groups!r}, group_topk={group_topk!r}"
        )
    if num_experts % num_groups != 0:
        raise ValueError(f"{name}: num_groups={num_groups} must divide the {num_experts} experts")
    if not 1 <= group_topk <= num_groups or topk % group_topk != 0:
        raise ValueError(
            f"{name}: group_topk={group_topk} must be in [1, num_groups={num_groups}] and "
            f"divide topk={topk}"
        )
    per_group = num_experts // num_groups
    if topk // group_topk > per_group:
        raise ValueError(
            f"{name}: topk={topk} over group_topk={group_topk} groups takes "
            f"{topk // group_topk} experts a group; a group has {per_group}"
        )
    return num_groups, group_topk


def _top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[rows, k]`` column indices of each row's ``k`` largest scores, lower index first among
    equal scores (a stable sort: ``torch.topk`` leaves the order of ties unspecified)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _choose(scores: torch.Tensor, topk: int, grouping) -> torch.Tensor:
    """The chosen experts, ``[tokens, topk]``. With grouping, only experts of the
    ``group_topk`` groups whose best ``topk // group_topk`` scores sum highest compete."""
    if grouping is None:
        return _top_indices(scores, topk)
    num_groups, group_topk = grouping
    tokens, num_experts = scores.shape
    grouped = scores.reshape(tokens, num_groups, num_experts // num_groups)
    best = torch.gather(grouped, 2, _top_indices(grouped, topk // group_topk))
    chosen_groups = _top_indices(best.sum(dim=2), group_topk)
    allowed = torch.zeros(tokens, num_groups, dtype=torch.bool, device=scores.device)
    allowed.scatter_(1, chosen_groups, True)
    allowed = allowed.unsqueeze(2).expand_as(grouped).reshape(tokens, num_experts)
    return _top_indices(scores.masked_fill(~allowed, float("-inf")), topk)


def _dense(values: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    out = values.new_zeros(values.shape[0], num_experts)
    return out.scatter(1, indices, values)


def _routing_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    out = torch.zeros(indices.shape[0], num_experts, dtype=torch.bool, device=indices.device)
    return out.scatter_(1, indices, True)


def fused_topk_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool,
    num_groups: int | None,
    group_topk: int | None,
    scaling_factor: float | None,
    score_function: str,
    expert_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``topk`` experts and routing probabilities: ``(probs, routing_map)``.

    ``logits``: ``[..., num_experts]``. ``score_function="softmax"``: with
    ``use_pre_softmax`` the probabilities are the softmax over all experts at the chosen ones;
    without, the softmax over the chosen logits only (the choice is the same either way).
    ``"sigmoid"``: the sigmoid of each logit; ``expert_bias`` (``[num_experts]``, sigmoid
    only) is added for the choice only; with ``topk > 1`` the chosen scores are divided by
    their sum (plus 1e-20). ``num_groups`` / ``group_topk`` (both, or neither: ``None``, 0
    or -1): the experts form ``num_groups`` equal consecutive groups, and only the
    ``group_topk`` groups whose best ``topk // group_topk`` scores sum highest compete.
    ``scaling_factor`` (``None``: 1) multiplies the probabilities.

    Returns ``probs`` in the logits' dtype, zero where not routed, and ``routing_map``
    (bool, ``True`` where routed), both shaped like ``logits``.
    """
    name = "fused_topk_with_score_function"
    x, topk = _checked_rows(name, logits, topk, score_function)
    shape, num_experts, compute = logits.shape, x.shape[1], x.dtype
    grouping = _grouping(name, num_groups, group_topk, topk, num_experts)
    if expert_bias is not None:
        if score_function != "sigmoid":
            raise ValueError(
                f"{name}: expert_bias is used with score_function='sigmoid' only, got "
                f"{score_function!r}; pass expert_bias=None"
            )
        if expert_bias.shape != (num_experts,) or expert_bias.device != logits.device:
            raise ValueError(
                f"{name}: expert_bias must be [{num_experts}] on {logits.device}, got shape "
                f"{tuple(expert_bias.shape)} on {expert_bias.device}"
            )

    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1) if use_pre_softmax else x
        with torch.no_grad():
            chosen = _choose(scores.detach(), topk, grouping)
        probs = torch.gather(scores, 1, chosen)
        if not use_pre_softmax:
            probs = torch.softmax(probs, dim=-1)
    else:
        scores = torch.sigmoid(x)
        with torch.no_grad():
            steer = scores.detach()
            if expert_bias is not None:
                steer = steer + expert_bias.detach().to(compute)
            chosen = _choose(steer, topk, grouping)
        probs = torch.gather(scores, 1, chosen)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + _SIGMOID_NORM_EPSILON)
    if scaling_factor:
        probs = probs * scaling_factor
    dense = _dense(probs, chosen, num_experts).to(logits.dtype)
    return dense.reshape(shape), _routing_map(chosen, num_experts).reshape(shape)


def fused_compute_score_for_moe_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores the load-balancing loss reads, and each token's top ``topk`` of them:
    ``(routing_map, scores)``, both shaped like ``logits`` (``[..., num_experts]``).

    ``"softmax"``: the softmax over all experts, in float32 (float64 for float64 logits).
    ``"sigmoid"``: each logit's sigmoid, divided by the token's sum of them (plus 1e-20) when
    ``topk > 1``, in the logits' dtype. ``routing_map`` is bool, ``True`` at each token's
    ``topk`` highest scores (lower index first among equal ones).
    """
    x, topk = _checked_rows("fused_compute_score_for_moe_aux_loss", logits, topk, score_function)
    shape, num_experts, compute = logits.shape, x.shape[1], x.dtype
    if score_function == "softmax":
        scores = torch.softmax(x, dim=-1)
        out_dtype = compute
    else:
        scores = torch.sigmoid(x)
        if topk > 1:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + _SIGMOID_NORM_EPSILON)
        out_dtype = logits.dtype
    with torch.no_grad():
        chosen = _top_indices(scores.detach(), topk)
    routing_map = _routing_map(chosen, num_experts).reshape(shape)
    return routing_map, scores.to(out_dtype).reshape(shape)


def fused_moe_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens,
    num_experts: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, a 0-d tensor in ``probs``' dtype:

    ``sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * num_experts * coeff /
    (topk * total_num_tokens ** 2)``, accumulated in float32 (float64 for float64 ``probs``).

    ``probs``: ``[tokens, columns]``, usually ``[tokens, num_experts]`` (the scores of
    :func:`fused_compute_score_for_moe_aux_loss`; Megatron-LM's per-sequence loss passes
    ``[sequence, batch * num_experts]``, so ``num_experts`` is only a factor here);
    ``tokens_per_expert``: ``[columns]``, the tokens each column received (any number dtype;
    no gradient); ``total_num_tokens``: the tokens those counts are over (an int or a 0-d
    tensor, for instance after an all-reduce). The gradient reaches ``probs``.
    """
    name = "fused_moe_aux_loss"
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise TypeError(f"{name}: probs must be a floating-point tensor, got "
                        f"{getattr(probs, 'dtype', type(probs).__name__)}")  # fmt: skip
    if probs.dim() != 2:
        raise ValueError(
            f"{name}: probs must be 2-D [tokens, columns], got shape {tuple(probs.shape)}"
        )
    columns = probs.shape[1]
    if tokens_per_expert.shape != (columns,) or tokens_per_expert.device != probs.device:
        raise ValueError(
            f"{name}: tokens_per_expert must be [{columns}] (one count per column of probs) "
            f"on {probs.device}, got shape {tuple(tokens_per_expert.shape)} on "
            f"{tokens_per_expert.device}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"{name}: topk must be a positive int, got {topk!r}")
    compute = _compute_dtype(probs.dtype)
    per_expert = probs.to(compute).sum(dim=0)
    weighted = torch.sum(per_expert * tokens_per_expert.to(compute))
    if isinstance(total_num_tokens, torch.Tensor):
        total = total_num_tokens.to(device=probs.device, dtype=compute)
        loss = weighted * (num_experts * coeff) / (topk * total * total)
    else:
        loss = weighted * (num_experts * coeff / (topk * total_num_tokens * total_num_tokens))
    return loss.to(probs.dtype)
