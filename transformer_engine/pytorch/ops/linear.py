"""``te.ops.Linear``: ``BasicLinear`` + ``Bias`` as one fused operation.

``weight`` and ``bias`` are *properties* that resolve to the basic operations' current
parameters on every access, never registered aliases: upstream registered the basic
operations' parameters a second time on the ``Linear`` itself, so after deferred
initialization replaced them the aliases still pointed at the old meta tensors and
``parameters()`` yielded both (``seeds/001``). Here the parameters exist once, under
``basic_ops.<i>``, which are also the state-dict keys upstream keeps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .basic.basic_linear import BasicLinear
from .basic.bias import Bias
from .op import FusedOperation

__all__ = ["Linear"]

_ALIASES = ("weight", "bias")


class Linear(FusedOperation):
    """Linear layer ``y = x W^T + b`` made of a ``BasicLinear`` and (with ``bias``) a ``Bias``.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool, default True
    device : torch.device or str, optional
        Default: the current CUDA device when CUDA is available, else the CPU. ``"meta"``
        defers initialization (materialized on the first forward onto the input's device, or
        by ``reset_parameters()``).
    dtype : torch.dtype, optional
    rng_state_tracker_function : callable, optional
    accumulate_into_main_grad : bool, default False

    tensor_parallel_mode : {None, "column", "row"}, default None
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
    sequence_parallel : bool, default False
        As ``BasicLinear``'s. Column: the bias is split like the output features
        (``Bias(tensor_parallel=True)``). Row: the bias is whole and added after the
        reduction, so it counts once; under sequence parallelism, where it is added to this
        rank's tokens only, its gradient is summed over the group in backward, so every rank
        holds the whole gradient (unlike ``te.Linear``'s, which leaves that sum to the
        framework through ``bias.sequence_parallel``).

    Attributes
    ----------
    weight : torch.nn.Parameter
        Always ``basic_ops[0].weight`` as it is now (assigning sets the basic operation's).
    bias : torch.nn.Parameter or None
        Always ``basic_ops[1].bias`` as it is now, ``None`` without a bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group=None,
        sequence_parallel: bool = False,
        rng_state_tracker_function=None,
        accumulate_into_main_grad: bool = False,
    ) -> None:
        linear = BasicLinear(
            in_features,
            out_features,
            device=device,
            dtype=dtype,
            tensor_parallel_mode=tensor_parallel_mode,
            tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=sequence_parallel,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=accumulate_into_main_grad,
        )
        ops = [linear]
        if bias:
            parallel = linear.tensor_parallel_size > 1
            column = parallel and tensor_parallel_mode == "column"
            ops.append(
                Bias(
                    out_features,
                    device=device,
                    dtype=dtype,
                    tensor_parallel=column,
                    tensor_parallel_group=tensor_parallel_group if column else None,
                )
            )
            if parallel and tensor_parallel_mode == "row" and linear.sequence_parallel:
                group = tensor_parallel_group
                ops[-1]._grad_reduction_group = dist.group.WORLD if group is None else group
        super().__init__(ops)
        self.in_features = in_features
        self.out_features = out_features

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.basic_ops[0].weight

    @property
    def bias(self) -> torch.nn.Parameter | None:
        return self.basic_ops[1].bias if len(self.basic_ops) > 1 else None

    def register_parameter(self, name: str, param) -> None:
        # upstream's aliases make register_parameter("weight", p) set the basic operation's
        # parameter; nn.Module's would refuse the name, which the property already holds
        if name in _ALIASES and "basic_ops" in self.__dict__.get("_modules", {}):
            self.__setattr__(name, param)
            return
        super().register_parameter(name, param)

    def __setattr__(self, name: str, value) -> None:
        # nn.Module.__setattr__ would register a Parameter on this module, shadowed by the
        # property: route the two names to the basic operations instead.
        if name in _ALIASES and "basic_ops" in self.__dict__.get("_modules", {}):
            if name == "weight":
                self.basic_ops[0].weight = value
            elif len(self.basic_ops) > 1:
                self.basic_ops[1].bias = value
            elif value is not None:
                raise ValueError("Linear was built with bias=False; it has no bias to set")
            return
        super().__setattr__(name, value)
