"""How the linear-family modules take part in tensor (and sequence) parallelism: their
tensor-parallel arguments, the local shard sizes, the parameters' partition attributes, the
check before a forward, and the FP8 rules that keep every rank's scales consistent.

The communication itself is in :mod:`transformer_engine.pytorch._tensor_parallel`; where each
module puts it is described in docs/modules.md ("Tensor parallelism").
"""

from __future__ import annotations

from .._sequence_parallel_input import check_sequence_parallel_scaling, reduce_amaxes_over
from .._tensor_parallel import (
    get_distributed_world_size,
    reduce_from_tensor_parallel_region,
    set_tensor_model_parallel_attributes,
)
from .._userbuffers import check_comm_overlap_ready, comm_overlap_flags
from ._linear_function import linear

__all__ = [
    "configure_tensor_parallel",
    "configure_comm_overlap",
    "local_parameters_split",
    "mark_partitioned",
    "mark_sequence_parallel",
    "check_tensor_parallel_ready",
    "reduce_split_amaxes",
    "parallel_gemm",
]


def configure_tensor_parallel(
    module, *, tp_group, tp_size: int, parallel_mode, sequence_parallel: bool
) -> None:
    """Set ``tp_group``, ``tp_size``, ``parallel_mode``, ``sequence_parallel`` and
    ``tp_group_initialized`` on ``module`` as upstream does: the group's size wins over
    ``tp_size``; ``tp_size > 1`` without a group waits for ``set_tensor_parallel_group``;
    sequence parallelism only takes effect with more than one rank."""
    owner = type(module).__name__
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(
            f"{owner}: parallel_mode={parallel_mode!r} must be None, 'column' or 'row'"
        )
    if tp_group is None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"{owner}: tp_size={tp_size!r} must be a positive int")
        module.tp_size = tp_size
        module.tp_group_initialized = tp_size == 1
    else:
        module.tp_size = get_distributed_world_size(tp_group)
        module.tp_group_initialized = True
    module.tp_group = tp_group
    module.parallel_mode = parallel_mode
    module.sequence_parallel = module.tp_size > 1 and bool(sequence_parallel)


def configure_comm_overlap(module, parallel_mode, ub_name=None, **ub_flags) -> None:
    """``module.comm_overlap``: which of the module's tensor-parallel collectives run chunk by
    chunk with their GEMMs, from its ``ub_*`` arguments (``_userbuffers.comm_overlap_flags``;
    ``None``: none). Call after :func:`configure_tensor_parallel`."""
    module.comm_overlap = comm_overlap_flags(
        type(module).__name__, parallel_mode=parallel_mode,
        sequence_parallel=module.sequence_parallel, ub_name=ub_name, **ub_flags,
    )  # fmt: skip


def local_parameters_split(owner: str, parameters_split, tp_size: int):
    """Column-parallel ``parameters_split``: every named size divided by ``tp_size``
    (``RuntimeError`` when one does not divide, as upstream)."""
    if tp_size == 1 or not isinstance(parameters_split, dict):
        return parameters_split
    local = {}
    for name, size in parameters_split.items():
        if size % tp_size:
            raise RuntimeError(
                f"{owner}: parameters_split[{name!r}]={size} is not divisible by "
                f"tp_size={tp_size}; column parallelism splits every part over the ranks"
            )
        local[name] = size // tp_size
    return local


def mark_partitioned(module, name: str, dim: int, is_parallel: bool = True) -> None:
    """Upstream's partition attributes on parameter ``name`` (kept through
    ``reset_parameters`` and ``to_empty``: the base module re-applies them)."""
    param = getattr(module, name)
    if param is None:
        return
    set_tensor_model_parallel_attributes(param, is_parallel, dim, 1)
    module._param_attributes.setdefault(name, {}).update(
        tensor_model_parallel=is_parallel, partition_dim=dim, partition_stride=1
    )


def mark_sequence_parallel(module, name: str, value: bool) -> None:
    """``param.sequence_parallel``: its gradient is a partial sum over this rank's tokens, which
    the training framework all-reduces over the tensor-parallel group."""
    param = getattr(module, name)
    if param is None:
        return
    param.sequence_parallel = value
    module._param_attributes.setdefault(name, {})["sequence_parallel"] = value


def check_tensor_parallel_ready(module, *, gathers_input: bool = True) -> None:
    """Before a forward with ``tp_size > 1``: a group must be set and have ``tp_size`` ranks;
    under delayed scaling with sequence parallelism the amaxes must be reduced over a group that
    contains the tensor-parallel group (every rank casts the gathered input with one scale).
    ``gathers_input=False``: the module gathers nothing (GroupedLinear), so the last rule does
    not apply."""
    if module.tp_size == 1:
        return
    owner = type(module).__name__
    if not module.tp_group_initialized:
        raise RuntimeError(
            f"{owner}: tp_size={module.tp_size} but no tensor-parallel group is set; pass "
            "tp_group=... or call set_tensor_parallel_group(group) before the forward"
        )
    size = get_distributed_world_size(module.tp_group)
    if size != module.tp_size:
        raise RuntimeError(
            f"{owner}: tp_size={module.tp_size} but the tensor-parallel group has {size} "
            "rank(s); initialize torch.distributed and pass a group of tp_size ranks"
        )
    if gathers_input and module.fp8 and module.sequence_parallel:
        check_sequence_parallel_scaling(owner, module.fp8_meta.get("recipe"), module.tp_group)
    check_comm_overlap_ready(owner, getattr(module, "comm_overlap", None), module.tp_size)


def reduce_split_amaxes(module, config, *, input_split: bool, grad_output_split: bool) -> None:
    """Current scaling: a GEMM operand split over the ranks along its features (a row-parallel
    input, a column-parallel output gradient) gets its amax all-reduced (MAX) over the
    tensor-parallel group, so every rank casts with the scale the whole tensor has."""
    if not (config.fp8 and module.tp_size > 1):
        return
    split = [config.input_quantizer] if input_split else []
    if grad_output_split:
        split.append(config.grad_output_quantizer)
    reduce_amaxes_over(split, module.tp_group)


def parallel_gemm(module, weight, inp, bias, config, backward_update, gemm=linear):
    """One GEMM of ``module`` with the collectives of its ``parallel_mode``:

    * column: the input gradient is all-reduced by the GEMM's node (overlapped with the weight
      gradient's GEMM); under sequence parallelism the input is all-gathered along dim 0 first
      and its gradient reduce-scattered;
    * row: the output is all-reduced (under sequence parallelism reduce-scattered along dim 0
      by the GEMM's node, which all-gathers the output gradient, in FP8 where the grad-output
      quantizer allows) and the bias added after the reduction, so it counts once;
    * ``None`` or one rank: no communication.

    Under sequence parallelism ``module.comm_overlap`` (its ``ub_*`` flags) says which of the
    gathers and reduce-scatters run chunk by chunk with the GEMM.

    ``gemm``: the differentiable GEMM (``_linear_function.linear``'s signature).
    """
    mode = module.parallel_mode if module.tp_size > 1 else None
    group = module.tp_group
    if mode == "column":
        if module.sequence_parallel:
            return gemm(weight, inp, bias, config, backward_update, group,
                        overlap=module.comm_overlap)  # fmt: skip
        return gemm(weight, inp, bias, config, backward_update, input_gradient_group=group)
    if mode == "row":
        if module.sequence_parallel:
            out = gemm(weight, inp, None, config, backward_update, None, group,
                       overlap=module.comm_overlap)  # fmt: skip
        else:
            out = reduce_from_tensor_parallel_region(
                gemm(weight, inp, None, config, backward_update), group
            )
        return out if bias is None else out + bias
    return gemm(weight, inp, bias, config, backward_update)
