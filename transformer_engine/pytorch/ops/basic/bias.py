"""``Bias``: ``y = x + b`` over the last dimension."""

from __future__ import annotations

import torch

from ..._tensor_parallel import allreduce, divide, set_tensor_model_parallel_attributes
from ...device import construction_device, materialization_device
from ..op import BasicOperation, OperationContext
from ._common import autocast_dtype, check_params_dtype, plain
from ._linear_parallelism import tensor_parallel_size

__all__ = ["Bias"]


class Bias(BasicOperation):
    """Add a learnable bias (initialized to zero) to the last dimension.

    Parameters
    ----------
    size : int
        Size of the last dimension.
    device : torch.device or str, optional
        Default: the current CUDA device when CUDA is available, else the CPU. ``"meta"``
        defers initialization to ``reset_parameters()`` or the first forward (onto the
        input's device).
    dtype : torch.dtype, optional
        Parameter dtype; default ``torch.get_default_dtype()``.
    tensor_parallel : bool, default False
        The bias of a column-parallel linear: this rank holds ``size / tp`` of it
        (``local_size``), ``tp`` being the size of ``tensor_parallel_group`` (default: the world
        group; ``torch.distributed`` must be initialized). No communication.
    tensor_parallel_group : torch.distributed.ProcessGroup, optional
    """

    def __init__(
        self,
        size: int,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        tensor_parallel: bool = False,
        tensor_parallel_group=None,
    ) -> None:
        super().__init__()
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"Bias: size={size!r} must be a positive int")
        self.size = size
        self.tensor_parallel = bool(tensor_parallel)
        self.tensor_parallel_group = tensor_parallel_group
        self.tensor_parallel_size = 1
        self.local_size = size
        if self.tensor_parallel:
            self.tensor_parallel_size = tensor_parallel_size("Bias", tensor_parallel_group)
            self.local_size = divide(size, self.tensor_parallel_size, "Bias: size")
        # Set by a row-parallel te.ops.Linear under sequence parallelism: the bias follows the
        # reduce-scatter, so its gradient here sums this rank's tokens only; summing over the
        # group gives every rank the whole gradient, as without tensor parallelism.
        self._grad_reduction_group = None
        dtype = check_params_dtype("Bias", dtype)
        device = construction_device("Bias", device)
        self.bias = torch.nn.Parameter(torch.empty(self.local_size, dtype=dtype, device=device))
        if self.tensor_parallel_size > 1:  # Megatron-LM's partition attributes, as the weight's
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        if device.type != "meta":
            self.reset_parameters()

    def folds_into(self, linear) -> bool:
        """Whether a fusion may compute this bias inside ``linear``'s GEMM or its gradient cast:
        it has the linear's (local) output width and no gradient reduction of its own."""
        return (
            self.local_size == getattr(linear, "local_out_features", None)
            and self._grad_reduction_group is None
        )

    def check_width(self, width: int) -> None:
        """``ValueError`` unless the tensor the bias is added to has ``width`` = the bias's
        (local) size as its last dimension."""
        if width != self.local_size:
            raise ValueError(
                f"Bias: the input's last dimension is {width} but the bias has "
                f"{self.local_size} (size={self.size}"
                + (f" over {self.tensor_parallel_size} ranks)" if self.tensor_parallel else ")")
            )

    def reset_parameters(self, device=None) -> None:
        """Zero the bias; a meta bias is materialized first (on ``device`` if given, else the
        current CUDA device, else the CPU). A bias with storage is zeroed in place."""
        old = self.bias
        if old.is_meta:
            values = torch.zeros(old.shape, dtype=old.dtype, device=materialization_device(device))
            new = torch.nn.Parameter(values, requires_grad=old.requires_grad)
            for attr, value in vars(old).items():
                if not isinstance(value, torch.Tensor):
                    setattr(new, attr, value)
            self.bias = new
        else:
            with torch.no_grad():
                old.zero_()

    def bias_forward(self, ctx: OperationContext) -> torch.Tensor:
        """Record what :meth:`op_backward` needs; returns the bias parameter."""
        bias = self.bias
        ctx.bias_requires_grad = bias.requires_grad
        ctx.bias_dtype = bias.dtype
        return bias

    def bias_grad(self, ctx: OperationContext, grad_output: torch.Tensor) -> torch.Tensor | None:
        """``grad_output`` summed over every dimension but the last (``None`` if not needed)."""
        if not ctx.bias_requires_grad:
            return None
        grad = grad_output.reshape(-1, self.local_size).sum(dim=0).to(ctx.bias_dtype)
        if self._grad_reduction_group is not None:
            grad = allreduce(grad, self._grad_reduction_group)[0]
        return grad

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        self.check_width(input_.shape[-1])
        x = plain(input_)
        dtype = autocast_dtype(x) or x.dtype
        bias = self.bias_forward(ctx)
        return x.to(dtype) + bias.to(dtype)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        grad_output = plain(grad_output)
        return grad_output, [self.bias_grad(ctx, grad_output)]
