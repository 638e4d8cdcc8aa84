"""Adam's step over lists of tensors: upstream's ``multi_tensor_adam`` family.

The step, element by element in float32 (upstream's kernels' order of operations)::

    g = grad                                    (times inv_scale in the capturable forms)
    g = g + weight_decay * p                    (mode 0, L2 regularization)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v / bc2) + eps                 (bc = 1 - beta ** step, or 1 without
    update = (m / bc1) / denom                   bias correction)
    update = update + weight_decay * p          (mode 1, AdamW's decoupled decay)
    p = p - lr * update

``p`` is the float32 master when one is given (a fifth list), which the parameter then
receives rounded to its own dtype. The moments may be kept in any floating dtype: they are
read into float32 and written back rounded. Every function works in place on its lists and
returns nothing.
"""

from __future__ import annotations

import torch

from .multi_tensor_ops import as_float32, check_lists

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "adam_update",
    "split_bf16_remainder",
    "join_bf16_remainder",
]


def adam_update(grads, params, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, step, mode,
                bias_correction, weight_decay, inv_scale=None):  # fmt: skip
    """The step on float32 lists, in place: ``params``, ``exp_avgs``, ``exp_avg_sqs`` are
    updated; ``grads`` is only read. ``lr`` and ``step`` may be Python numbers or one-element
    device tensors (then nothing here reads a value back to the host)."""
    if not params:
        return
    g = list(grads)
    if inv_scale is not None:
        g = torch._foreach_mul(g, inv_scale.reshape(()).to(torch.float32))
    if mode == 0 and weight_decay != 0.0:
        g = torch._foreach_add(g, params, alpha=weight_decay)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, g, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - beta2)
    if bias_correction:
        if isinstance(step, torch.Tensor):
            # pow(Scalar, Tensor): no host value goes to the device (safe in graph capture).
            # In float64, as the Python numbers of the other form: 1 - beta2 in float32 is
            # 5e-5 off for beta2 = 0.999.
            step = step.reshape(()).to(torch.float64)
            bc1 = (1.0 - torch.pow(float(beta1), step)).to(torch.float32)
            bc2 = (1.0 - torch.pow(float(beta2), step)).to(torch.float32)
        else:
            bc1 = 1.0 - beta1 ** int(step)
            bc2 = 1.0 - beta2 ** int(step)
        denom = torch._foreach_div(exp_avg_sqs, bc2)
        update = torch._foreach_div(exp_avgs, bc1)
    else:
        denom = [v.clone() for v in exp_avg_sqs]
        update = [m.clone() for m in exp_avgs]
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(update, denom)
    if mode == 1 and weight_decay != 0.0:
        torch._foreach_add_(update, params, alpha=weight_decay)
    if isinstance(lr, torch.Tensor):
        torch._foreach_mul_(update, lr.reshape(()).to(torch.float32))
        torch._foreach_sub_(params, update)
    else:
        torch._foreach_add_(params, update, alpha=-float(lr))


def _run(lists, write_params_to, noop_flag=None, **kwargs) -> None:
    """The step on ``lists = [g, p, m, v]`` (float32 copies made where needed), then the
    results written back into the original tensors (and ``write_params_to``). With a
    ``noop_flag`` (the capturable forms), a flag of 1 leaves every tensor as it was."""
    grads, params, exp_avgs, exp_avg_sqs = lists
    p32, m32, v32 = as_float32(params), as_float32(exp_avgs), as_float32(exp_avg_sqs)
    if noop_flag is not None:
        # Work on copies, then keep them only where the flag is clear (no host sync).
        p32 = [t.clone() for t in p32]
        m32 = [t.clone() for t in m32]
        v32 = [t.clone() for t in v32]
    adam_update(as_float32(grads), p32, m32, v32, **kwargs)
    skip = None if noop_flag is None else (noop_flag.reshape(()) != 0)
    for targets, values in ((params, p32), (exp_avgs, m32), (exp_avg_sqs, v32)):
        for dst, value in zip(targets, values):
            if skip is not None:
                dst.copy_(torch.where(skip.to(dst.device), dst.float(), value))
            elif dst is not value:
                dst.copy_(value)
    for dst, src in zip(write_params_to, params):
        if skip is not None:
            dst.copy_(torch.where(skip.to(dst.device), dst, src.to(dst.dtype)))
        else:
            dst.copy_(src)


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                      bias_correction, weight_decay):  # fmt: skip
    """``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``, or with a fifth list of
    float32 masters: the masters take the step and the params receive them rounded."""
    del chunk_size, noop_flag
    lists = check_lists("multi_tensor_adam", tensor_lists, (4, 5))
    kwargs = dict(lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step, mode=int(mode),
                  bias_correction=bool(bias_correction), weight_decay=float(weight_decay))  # fmt: skip
    if len(lists) == 5:
        _run([lists[0], lists[4], lists[2], lists[3]], lists[1], **kwargs)
    else:
        _run(lists, [], **kwargs)


def split_bf16_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 tensor as ``(bfloat16 value, int16 remainder)`` that :func:`join_bf16_remainder`
    turns back into the same float32 bits.

    The remainder is the lower 16 bits read as a signed integer; the bfloat16 is the upper half
    plus one when the lower half's top bit is set (the float32 rounded to nearest, ties away
    from zero), so that ``(bfloat16 bits << 16) + remainder`` is the float32's bits exactly.
    """
    bits = master.contiguous().view(torch.int32)
    remainder = bits.to(torch.int16)  # the low half, wrapped to a signed value
    upper = (bits - remainder.to(torch.int32)) >> 16
    return upper.to(torch.int16).view(torch.bfloat16), remainder


def join_bf16_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 tensor that :func:`split_bf16_remainder` split into ``param`` and
    ``remainder``."""
    upper = param.contiguous().view(torch.int16).to(torch.int32) << 16
    return (upper + remainder.to(torch.int32)).view(torch.float32)


def multi_tensor_adam_param_remainder(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2,
                                      epsilon, step, mode, bias_correction, weight_decay):  # fmt: skip
    """``tensor_lists = [grads, bf16 params, exp_avgs, exp_avg_sqs, int16 remainders]``: each
    float32 master is the pair (param, remainder) (:func:`join_bf16_remainder`); both halves
    are rewritten from the updated master."""
    del chunk_size, noop_flag
    grads, params, exp_avgs, exp_avg_sqs, remainders = check_lists(
        "multi_tensor_adam_param_remainder", tensor_lists, (5,)
    )
    for p in params:
        if p.dtype != torch.bfloat16:
            raise TypeError(
                f"multi_tensor_adam_param_remainder: params must be bfloat16, got {p.dtype}"
            )
    masters = [join_bf16_remainder(p, r) for p, r in zip(params, remainders)]
    _run([grads, masters, exp_avgs, exp_avg_sqs], [], lr=lr, beta1=beta1, beta2=beta2,
         eps=epsilon, step=step, mode=int(mode), bias_correction=bool(bias_correction),
         weight_decay=float(weight_decay))  # fmt: skip
    for p, r, master in zip(params, remainders, masters):
        value, low = split_bf16_remainder(master)
        p.copy_(value)
        r.copy_(low)


def multi_tensor_adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon,
                                 step, mode, bias_correction, weight_decay, inv_scale):  # fmt: skip
    """:func:`multi_tensor_adam` with ``lr`` and ``step`` as device tensors, the gradients
    times ``inv_scale`` (a device tensor), and nothing changed while ``noop_flag`` is 1: no
    value is read back to the host, so the step can be captured in a CUDA graph."""
    del chunk_size
    lists = check_lists("multi_tensor_adam_capturable", tensor_lists, (4,))
    _run(lists, [], noop_flag=noop_flag, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon,
         step=step, mode=int(mode), bias_correction=bool(bias_correction),
         weight_decay=float(weight_decay), inv_scale=inv_scale)  # fmt: skip


def multi_tensor_adam_capturable_master(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2,
                                        epsilon, step, mode, bias_correction, weight_decay,
                                        inv_scale):  # fmt: skip
    """:func:`multi_tensor_adam_capturable` with a fifth list of float32 masters, which take
    the step; the params receive them rounded."""
    del chunk_size
    lists = check_lists("multi_tensor_adam_capturable_master", tensor_lists, (5,))
    _run([lists[0], lists[4], lists[2], lists[3]], lists[1], noop_flag=noop_flag, lr=lr,
         beta1=beta1, beta2=beta2, eps=epsilon, step=step, mode=int(mode),
         bias_correction=bool(bias_correction), weight_decay=float(weight_decay),
         inv_scale=inv_scale)  # fmt: skip
