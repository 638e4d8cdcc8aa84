"""``te.optimizers.FusedAdam``: Adam and AdamW over lists of tensors, with master weights,
narrow moment dtypes, FP8 parameters and a CUDA-graph-capturable form.

The step runs on float32 working values of all of a device's parameters at once: PyTorch's fused
Adam kernel (``torch._fused_adamw_`` / ``_fused_adam_``: one pass over each tensor; the update of
``torch.optim.AdamW`` / ``Adam``, which is upstream's up to float32 rounding), or, without bias
correction (which that kernel always applies), :func:`._adam_math.adam_update` on foreach
kernels. What is kept between steps:

- ``exp_avg`` / ``exp_avg_sq`` in ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (float32, float16,
  bfloat16, or ``torch.uint8`` = FP8 E4M3 bytes; float16 and FP8 stored with a per-tensor scale,
  :mod:`._scaled_state`);
- with ``master_weights=True``, ``master_param`` in ``master_weight_dtype`` (float32 or
  float16): the step runs on it and the parameter receives it rounded (a quantized parameter
  re-quantized with its own quantizer); with ``store_param_remainders=True`` a bfloat16
  parameter's float32 master is kept as its low 16 bits only, the parameter holding the rest;
- the step count ``param_group["step"]`` (a device tensor when ``capturable``).

``state_dict()`` gives every kept tensor as its float32 value, whatever dtype it is kept in, so
a checkpoint loads into an optimizer with other state dtypes; ``load_state_dict`` stores them
back in this optimizer's dtypes.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from ..quantized_tensor import QuantizedTensor
from ..tensor.float8_tensor import Float8Tensor
from . import _scaled_state
from ._adam_math import adam_update, join_bf16_remainder, split_bf16_remainder
from .multi_tensor_ops import flag_nonfinite

__all__ = ["FusedAdam"]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def _check_dtype(name: str, dtype, allowed) -> None:
    if dtype not in allowed:
        raise ValueError(
            f"FusedAdam: {name}={dtype} is not supported; use one of "
            f"{', '.join(str(d) for d in allowed)}"
        )


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adam_w_mode=False``: L2 regularization added to the gradient) or AdamW
    (``adam_w_mode=True``, the default: decoupled weight decay), upstream's signature.

    Parameters
    ----------
    params : iterable of parameters or of parameter-group dicts
    lr, betas, eps, weight_decay : as ``torch.optim.AdamW``
    amsgrad : bool
        Not supported (upstream neither): ``True`` raises ``RuntimeError``.
    bias_correction : bool, default True
    adam_w_mode : bool, default True
    capturable : bool, default False
        ``lr`` and the step count live on the device and a step reads nothing back to the host,
        so it can be captured in a CUDA graph. Needs float32 master weights (when
        ``master_weights``) and moments that are both float32 or both bfloat16.
    master_weights : bool, default False
        Keep a ``master_weight_dtype`` copy of each parameter and step that. Required for
        quantized parameters other than ``Float8Tensor`` (block-scaled ones).
    master_weight_dtype : torch.float32 or torch.float16
    exp_avg_dtype, exp_avg_sq_dtype : torch.float32, float16, bfloat16 or uint8 (FP8)
    use_decoupled_grad : bool, default False
        Read each parameter's gradient from ``param.decoupled_grad`` instead of ``param.grad``.
    store_param_remainders : bool, default False
        With float32 master weights, keep a bfloat16 parameter's master as the 16 bits the
        parameter lacks (the parameter is then the master rounded to nearest, ties away from
        zero). No effect for other parameters.
    set_grad_none : bool, optional
        Deprecated: ``zero_grad(set_to_none=...)`` decides.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, bias_correction=True, adam_w_mode=True, capturable=False,
                 master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False,
                 set_grad_none=None):  # fmt: skip
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant; use torch.optim.Adam("
                "amsgrad=True) for it"
            )
        lr_value = float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())
        if not lr_value >= 0.0:
            raise ValueError(f"FusedAdam: invalid learning rate {lr}; it must be >= 0")
        if not float(eps) >= 0.0:
            raise ValueError(f"FusedAdam: invalid eps {eps}; it must be >= 0")
        betas = tuple(float(b) for b in betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: invalid betas {betas}; two values in [0, 1)")
        if not float(weight_decay) >= 0.0:
            raise ValueError(f"FusedAdam: invalid weight_decay {weight_decay}; it must be >= 0")
        _check_dtype("master_weight_dtype", master_weight_dtype, (torch.float32, torch.float16))
        _check_dtype("exp_avg_dtype", exp_avg_dtype, _scaled_state.STATE_DTYPES)
        _check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype, _scaled_state.STATE_DTYPES)
        if capturable:
            if master_weights and master_weight_dtype != torch.float32:
                raise ValueError(
                    "FusedAdam(capturable=True) needs float32 master weights, got "
                    f"master_weight_dtype={master_weight_dtype}"
                )
            if (exp_avg_dtype, exp_avg_sq_dtype) not in (
                (torch.float32, torch.float32),
                (torch.bfloat16, torch.bfloat16),
            ):
                raise ValueError(
                    "FusedAdam(capturable=True) needs exp_avg_dtype and exp_avg_sq_dtype both "
                    f"float32 or both bfloat16, got {exp_avg_dtype} and {exp_avg_sq_dtype}"
                )
            if store_param_remainders:
                raise ValueError(
                    "FusedAdam: store_param_remainders is not supported with capturable=True; "
                    "keep whole float32 master weights for a captured step"
                )
        if set_grad_none is not None:
            warnings.warn(
                "FusedAdam(set_grad_none=...) is deprecated; pass set_to_none to zero_grad()",
                DeprecationWarning,
                stacklevel=2,
            )
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=betas,
                        eps=float(eps), weight_decay=float(weight_decay))  # fmt: skip
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = bool(capturable)
        self.master_weights = bool(master_weights)
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.store_param_remainders = bool(store_param_remainders)
        self.set_grad_none = set_grad_none
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        # param -> {state name: one-element float32 scale} for the scaled dtypes.
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    # Gradients ------------------------------------------------------------------------------

    def _grad(self, param):
        if self.use_decoupled_grad:
            return getattr(param, "decoupled_grad", None)
        return param.grad

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear every parameter's gradient (``decoupled_grad`` with ``use_decoupled_grad``):
        ``None`` when ``set_to_none`` (default: ``set_grad_none`` if given, else True)."""
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        # torch's zero_grad for the attribute it does not know.
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is None:
                    continue
                if set_to_none:
                    p.decoupled_grad = None
                else:
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()

    # State ----------------------------------------------------------------------------------

    def _keeps_remainder(self, param) -> bool:
        return (
            self.store_param_remainders
            and self.master_weights
            and self.master_weight_dtype == torch.float32
            and param.dtype == torch.bfloat16
            and not isinstance(param, QuantizedTensor)
        )

    @staticmethod
    def _param_value(param) -> torch.Tensor:
        """The parameter's value in float32 (dequantized for a quantized one)."""
        if isinstance(param, QuantizedTensor):
            return param.dequantize(dtype=torch.float32)
        return param.detach().float()

    @torch.no_grad()
    def initialize_state(self, param, store_param_remainders: bool | None = None) -> None:
        """Zero moments and, with master weights, the master copy of ``param`` (its
        high-precision initial value where the module preserved one), for whichever of them
        ``param``'s state does not hold yet (a caller may have set some itself).
        ``store_param_remainders`` defaults to the optimizer's setting."""
        if store_param_remainders is None:
            store_param_remainders = self.store_param_remainders
        state = self.state[param]
        scales = self._scales.setdefault(param, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name not in state:
                dtype = self.name_to_dtype_map[name]
                state[name], scale = _scaled_state.empty_stored(param, dtype)
                if scale is not None:
                    scales[name] = scale
        if not self.master_weights or "master_param" in state:
            return
        if store_param_remainders and self._keeps_remainder(param):
            # The bfloat16 value widened exactly: its low 16 bits are zero.
            state["master_param"] = _scaled_state.zeros_like(param, torch.int16)
            return
        value = None
        get_init = getattr(param, "get_high_precision_init_val", None)
        if get_init is not None and get_init() is not None:
            value = get_init().to(device=param.device, dtype=torch.float32)
            param.clear_high_precision_init_val()
        if value is None:
            value = self._param_value(param)
        state["master_param"], scale = _scaled_state.empty_stored(param, self.master_weight_dtype)
        if scale is not None:
            scales["master_param"] = scale
        _scaled_state.store(value, state["master_param"], scale)

    @torch.no_grad()
    def get_unscaled_state(self, param, state_name: str) -> torch.Tensor:
        """``state_name``'s value for ``param`` in float32 (unscaled; a kept remainder joined
        with the parameter into the whole float32 master)."""
        stored = self.state[param][state_name]
        if state_name == "master_param" and stored.dtype == torch.int16:
            return join_bf16_remainder(param.detach(), stored)
        return _scaled_state.load(stored, self._scales.get(param, {}).get(state_name))

    @torch.no_grad()
    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store the float32 ``unscaled_state`` as ``state_name`` of ``param`` in this
        optimizer's dtype (a float32 master with remainders rewrites the bfloat16 parameter
        too; an int16 tensor is taken as the remainder itself)."""
        if state_name not in _STATE_NAMES:
            raise KeyError(f"FusedAdam: unknown state {state_name!r}; one of {_STATE_NAMES}")
        state = self.state[param]
        if state_name not in state:
            self.initialize_state(param, self.store_param_remainders)
            if state_name not in state:
                raise ValueError(f"FusedAdam: {state_name!r} is not kept (master_weights=False)")
        stored = state[state_name]
        value = unscaled_state.detach().to(device=stored.device)
        if stored.dtype == torch.int16:
            if value.dtype == torch.int16:
                stored.copy_(value)
                return
            bf16, low = split_bf16_remainder(value.float())
            param.detach().copy_(bf16)
            stored.copy_(low)
            return
        scale = self._scales.get(param, {}).get(state_name)
        _scaled_state.store(value.float(), stored, scale)

    def state_dict(self):
        """The optimizer's state with every kept tensor as its float32 value."""
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        sd["state"] = {
            index: {
                key: (self.get_unscaled_state(params[index], key) if key in _STATE_NAMES else v)
                for key, v in entry.items()
            }
            for index, entry in sd["state"].items()
        }
        return sd

    @torch.no_grad()
    def load_state_dict(self, state_dict) -> None:
        """Load a :meth:`state_dict` (from this or another state-dtype setting)."""
        saved = state_dict["state"]
        # The saved groups name their parameters by position (ints) or, through
        # torch.distributed.checkpoint, by fully qualified name: matched in order, as torch's.
        keys = [k for group in state_dict["param_groups"] for k in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_key = dict(zip(keys, params))
        super().load_state_dict(state_dict)
        for key, entry in saved.items():
            param = by_key[key]
            self.state[param] = {}
            self._scales.pop(param, None)
            self.initialize_state(param, self.store_param_remainders)
            for key, value in entry.items():
                if key == "master_param" and not self.master_weights:
                    continue  # the parameter itself holds the value here
                if key in _STATE_NAMES:
                    self.set_scaled_state(param, key, value)
                else:
                    self.state[param][key] = value

    # The step -------------------------------------------------------------------------------

    def _check_step_inputs(self, work) -> None:
        for param, grad in work:
            if grad.is_sparse:
                raise RuntimeError(
                    "FusedAdam does not support sparse gradients; use torch.optim.SparseAdam"
                )
            if isinstance(param, QuantizedTensor) and not (
                isinstance(param, Float8Tensor) or self.master_weights
            ):
                raise ValueError(
                    f"FusedAdam: a {type(param).__name__} parameter needs master_weights=True "
                    "(only Float8Tensor parameters are stepped without a master copy)"
                )
            if grad.device != param.device:
                raise ValueError(
                    f"FusedAdam: a gradient on {grad.device} for a parameter on {param.device}; "
                    "gradients must live on their parameter's device"
                )

    def _device_scalar(self, group, key, device, dtype=torch.float32) -> torch.Tensor:
        """``group[key]`` as a one-element tensor on ``device`` (capturable: kept there)."""
        value = group[key]
        if not isinstance(value, torch.Tensor) or value.device != device:
            value = torch.as_tensor(value, dtype=dtype).reshape(1).to(device)
            group[key] = value
        return value

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One optimizer step; returns ``closure()``'s loss when a closure is given.

        ``grad_scaler`` (a ``torch.amp.GradScaler`` whose scale is still in the gradients):
        the gradients are divided by its scale, and a step meeting an Inf or NaN gradient
        changes nothing (capturable: decided on the device). ``GradScaler.step(optimizer)``
        needs none of this: it unscales and skips by itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = []
        for group in self.param_groups:
            work = [(p, g) for p in group["params"] if (g := self._grad(p)) is not None]
            self._check_step_inputs(work)
            if group["params"]:
                plan.append((group, work))
        inv_scale = None
        if grad_scaler is not None:
            # None until the scaler's first scale() call, which would use its initial scale.
            scale = grad_scaler._get_scale_async()
            if scale is None:
                scale = torch.full((1,), float(grad_scaler.get_scale()), dtype=torch.float32)
            inv_scale = scale.double().reciprocal().float()
        buckets = []
        for group, work in plan:
            by_device = defaultdict(list)
            for param, grad in work:
                by_device[param.device].append((param, grad))
            for device, items in by_device.items():
                grads = [g if g.dtype == torch.float32 else g.float() for _, g in items]
                if inv_scale is not None:
                    grads = torch._foreach_mul(grads, inv_scale.to(device).reshape(()))
                buckets.append((group, device, items, grads))
        skip = None
        if inv_scale is not None and buckets:
            found = torch.zeros(1, dtype=torch.int32, device=buckets[0][1])
            for _, _, _, grads in buckets:
                flag_nonfinite(found, grads)
            if self.capturable:
                skip = found.reshape(()) != 0
            elif int(found.item()) != 0:
                return loss
        for group, _ in plan:
            self._advance_step(group, skip)
        for group, device, items, grads in buckets:
            self._step_device(group, device, items, grads, skip)
        return loss

    def _advance_step(self, group, skip) -> None:
        if not self.capturable:
            group["step"] = int(group.get("step", 0)) + 1
            return
        device = group["params"][0].device
        if "step" not in group:
            group["step"] = torch.zeros(1, dtype=torch.float32, device=device)
        step = self._device_scalar(group, "step", device)
        step.add_(1 if skip is None else (~skip).to(step.dtype))

    def _step_device(self, group, device, items, grads, skip) -> None:
        needed = _STATE_NAMES if self.master_weights else _STATE_NAMES[:2]
        for param, _ in items:
            state = self.state[param]
            if any(name not in state for name in needed):
                self.initialize_state(param)
        params = [p for p, _ in items]
        # PyTorch's fused Adam kernel (one pass over each tensor) computes this step up to
        # float32 rounding, bias correction included, and skips it itself on found_inf;
        # without bias correction, the foreach form.
        fused = bool(group["bias_correction"])
        # float32 working values: the kept tensors themselves where they are float32 (unless
        # the foreach form may have to restore them after a skip), new tensors otherwise.
        work_p, stepped_in_place = [], []
        for p in params:
            in_place = False
            if self.master_weights:
                value = self.get_unscaled_state(p, "master_param")
            elif isinstance(p, QuantizedTensor) or p.dtype != torch.float32:
                value = self._param_value(p)
            else:
                value, in_place = p.detach(), skip is None or fused
            work_p.append(value)
            stepped_in_place.append(in_place)
        work_m = [self.get_unscaled_state(p, "exp_avg") for p in params]
        work_v = [self.get_unscaled_state(p, "exp_avg_sq") for p in params]
        beta1, beta2 = group["betas"]
        lr, step = group["lr"], group["step"]
        if self.capturable:
            lr = self._device_scalar(group, "lr", device)
            step = group["step"].to(device)
        if fused:
            kernel = torch._fused_adamw_ if self.adam_w_mode == 1 else torch._fused_adam_
            if isinstance(lr, torch.Tensor):
                lr = lr.reshape(()).to(device=device, dtype=torch.float32)
            if not isinstance(step, torch.Tensor):
                step = torch.full((), float(step), dtype=torch.float32, device=device)
            # The kernel reads the step count (the caller advances it) and, with found_inf
            # set, changes nothing.
            kernel(work_p, grads, work_m, work_v, [], [step.reshape(())] * len(work_p), lr=lr,
                   beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                   eps=group["eps"], amsgrad=False, maximize=False,
                   found_inf=None if skip is None else skip.to(torch.float32).reshape(()))  # fmt: skip
            skip = None
        else:
            if skip is not None:
                old = [[t.clone() for t in lst] for lst in (work_p, work_m, work_v)]
            adam_update(grads, work_p, work_m, work_v, lr=lr, beta1=beta1, beta2=beta2,
                        eps=group["eps"], step=step, mode=self.adam_w_mode,
                        bias_correction=False, weight_decay=group["weight_decay"])  # fmt: skip
        if skip is not None:
            for new, prev in zip((work_p, work_m, work_v), old):
                for i, (a, b) in enumerate(zip(new, prev)):
                    new[i] = torch.where(skip.to(a.device), b, a)
        for p, m, v in zip(params, work_m, work_v):
            self._write_state(p, "exp_avg", m)
            self._write_state(p, "exp_avg_sq", v)
        for p, value, in_place in zip(params, work_p, stepped_in_place):
            if in_place:
                continue  # a float32 parameter stepped as itself
            if self.master_weights:
                self._write_state(p, "master_param", value)
                if self.state[p]["master_param"].dtype == torch.int16:
                    continue  # the parameter was rewritten with its remainder
                if self.master_weight_dtype != torch.float32:
                    value = self.get_unscaled_state(p, "master_param")  # as stored
            if isinstance(p, QuantizedTensor):
                p.quantize_(value)
            else:
                # Not torch._foreach_copy_: DTensors (FSDP2) have no sharding rule for it.
                p.detach().copy_(value)

    def _write_state(self, param, name, value) -> None:
        # A float32 state is its own working value (stepped in place) unless a skip replaced it.
        if self.state[param][name] is not value:
            self.set_scaled_state(param, name, value)
