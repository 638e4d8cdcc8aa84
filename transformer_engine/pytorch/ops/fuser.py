"""``OperationFuser``: a sequence of fusible operations run as one autograd function.

Device and deferred-initialization rules (docs/architecture.md; the upstream bug this avoids:
a fuser that cached ``Parameter`` objects at construction handed autograd the stale meta
parameters after the first forward replaced them):

* the forward runs with the input's device current and the backward with the gradient's
  (``device_guard``), and the caller's current device is restored on every exit;
* before each forward, operations whose parameters are still on ``meta`` are materialized onto
  the input's device; then the recipe state is (re)made on the parameters' device, and only
  then are the parameters read, from the operations themselves, on *every* call: the fuser
  keeps no parameter cache, so a replaced ``Parameter`` can never reach autograd;
* parameters on another device than the input are a ``ValueError`` naming both devices.

Fusions are functions ``func(ops, *, recipe) -> ops`` registered with
:func:`register_forward_backward_fusion`, :func:`register_forward_fusion` or
:func:`register_backward_fusion`: they map the list of basic operations (or the result of the
previous function) to a list in which runs of consecutive operations are replaced by
``FusedOperation``s covering them. The joint (forward-and-backward) functions run first and
their fused operations run both passes (an operation whose forward saves something only its
own backward understands, as a fused kernel's workspace, needs that). The forward-only and
the backward-only functions then each start from the joint result; they see its fused
operations as ordinary entries and may only pass them through. Every forward- or
backward-only fused operation reads and writes the contexts of the basic operations it covers
exactly as those operations would, so any forward fusion combines with any backward fusion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device import device_guard
from ..distributed import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled
from ..functional._once_differentiable import once_differentiable
from ..quantization import BackwardScaleUpdate, FP8GlobalStateManager, claim_backward_update
from ..quantized_tensor import prepare_for_saving, restore_from_saved
from .operation_context import OperationContext

__all__ = [
    "OperationFuser",
    "register_forward_backward_fusion",
    "register_forward_fusion",
    "register_backward_fusion",
]

# In annotations: te.ops.FusibleOperation / BasicOperation, which are not imported here because
# op.py imports this file (an operation's forward runs it through a fuser).
FusibleOp = torch.nn.Module
BasicOp = torch.nn.Module


@dataclass
class _Call:
    """Everything one forward decided that its backward needs (the plan of that call)."""

    basic_ops: list[BasicOp]
    forward_ops: list[tuple[FusibleOp, list[int]]]
    backward_ops: list[tuple[FusibleOp, list[int]]]
    basic_op_kwargs: list[dict]
    num_params: list[int]
    num_extra_inputs: list[int]
    num_extra_outputs: list[int]
    first_op_requiring_backward: int
    backward_update: BackwardScaleUpdate | None
    input_requires_grad: bool = False
    param_requires_grad: tuple = ()
    extra_input_requires_grad: tuple = ()


class _OperationFuserAutogradFunction(torch.autograd.Function):
    """Forward and backward of every basic operation of a fuser, as one graph node."""

    @staticmethod
    def forward(func_ctx, input_, call: _Call, *params_and_extra_inputs):  # noqa: D102
        return _fuser_forward(func_ctx, input_, call, params_and_extra_inputs)

    @staticmethod
    @once_differentiable
    def backward(func_ctx, grad_output, *grad_extra_outputs):  # noqa: D102
        call: _Call = func_ctx.call
        with device_guard(grad_output.device):
            grad_input, grad_params, grad_extra_inputs = _fuser_backward(
                func_ctx, call, grad_output, grad_extra_outputs
            )
            if call.backward_update is not None:
                call.backward_update.complete()
        return (grad_input, None, *grad_params, *grad_extra_inputs)


def _split(values, counts):
    out, start = [], 0
    for count in counts:
        out.append(tuple(values[start : start + count]))
        start += count
    return out


def _fuser_forward(func_ctx, input_, call: _Call, params_and_extra_inputs):
    recording = func_ctx is not None
    ops = call.basic_ops
    num_params = sum(call.num_params)
    extra_inputs = _split(params_and_extra_inputs[num_params:], call.num_extra_inputs)
    first = call.first_op_requiring_backward
    ctxs = [OperationContext() for _ in ops]
    for i, ctx in enumerate(ctxs):
        ctx.requires_grad = recording and i >= first
        # the input of the first operation needing a backward needs a gradient only when the
        # fuser's input does; every later operation's input depends on something trainable
        ctx.input_requires_grad = recording and (i > first or (i == first and input_.requires_grad))

    x = input_
    extra_outputs: list[tuple] = [() for _ in ops]
    for op, idxs in call.forward_ops:
        prev_q = ops[idxs[0] - 1].get_grad_output_quantizer() if idxs[0] > 0 else None
        next_q = ops[idxs[-1] + 1].get_input_quantizer() if idxs[-1] + 1 < len(ops) else None
        x, op_extra_outputs = op.fuser_forward(
            [ctxs[i] for i in idxs],
            x,
            basic_op_extra_inputs=[extra_inputs[i] for i in idxs],
            prev_op_grad_output_quantizer=prev_q,
            next_op_input_quantizer=next_q,
            basic_op_kwargs=[call.basic_op_kwargs[i] for i in idxs],
        )
        for i, extras in zip(idxs, op_extra_outputs):
            if len(extras) != call.num_extra_outputs[i]:
                raise RuntimeError(
                    f"{type(ops[i]).__name__} declares {call.num_extra_outputs[i]} extra "
                    f"outputs but produced {len(extras)}"
                )
            extra_outputs[i] = tuple(extras)

    if recording:
        to_save: list = []
        for ctx in ctxs:
            tensors, ctx._saved_objects = prepare_for_saving(*ctx.to_save)
            ctx._saved_tensors_range = (len(to_save), len(to_save) + len(tensors))
            to_save.extend(tensors)
            ctx.to_save = ()
        func_ctx.save_for_backward(*to_save)
        func_ctx.basic_op_ctxs = ctxs
        func_ctx.call = call

    flat_extra_outputs = [t for extras in extra_outputs for t in extras]
    if not flat_extra_outputs:
        return x
    return (x, *flat_extra_outputs)


def _fuser_backward(func_ctx, call: _Call, grad_output, grad_extra_outputs):
    ctxs: list[OperationContext] = func_ctx.basic_op_ctxs
    saved = func_ctx.saved_tensors
    for ctx in ctxs:
        start, stop = ctx._saved_tensors_range
        ctx.saved_tensors = tuple(restore_from_saved(ctx._saved_objects, saved[start:stop]))
    grad_extra_outputs_per_op = _split(grad_extra_outputs, call.num_extra_outputs)

    count = len(call.basic_ops)
    grad_params: list[list] = [[] for _ in range(count)]
    grad_extra_inputs: list[tuple] = [() for _ in range(count)]
    dx = grad_output
    for op, idxs in reversed(call.backward_ops):
        if not any(ctxs[i].requires_grad for i in idxs):
            break  # nothing before the first operation that needs a gradient
        dx, op_grad_params, op_grad_extra_inputs = op.fuser_backward(
            [ctxs[i] for i in idxs],
            dx,
            basic_op_grad_extra_outputs=[grad_extra_outputs_per_op[i] for i in idxs],
        )
        for i, params, extras in zip(idxs, op_grad_params, op_grad_extra_inputs):
            grad_params[i], grad_extra_inputs[i] = params, extras
    for op, ctx in zip(call.basic_ops, ctxs):  # free what the operations saved
        ctx.saved_tensors = ()
        # the storages restore_from_saved refilled hand their buffers back (they would keep
        # them as long as the graph lives); a second backward refills them
        for storage in ctx._saved_objects:
            if storage is not None:
                storage.prepare_for_saving()
        op.release_saved(ctx)

    flat_params: list = []
    for i, (grads, expected) in enumerate(zip(grad_params, call.num_params)):
        grads = list(grads) if grads else [None] * expected
        if len(grads) != expected:
            raise RuntimeError(
                f"{type(call.basic_ops[i]).__name__} returned {len(grads)} parameter gradients "
                f"for {expected} parameters"
            )
        flat_params.extend(grads)
    flat_params = [g if req else None for g, req in zip(flat_params, call.param_requires_grad)]
    flat_extras: list = []
    for grads, expected in zip(grad_extra_inputs, call.num_extra_inputs):
        grads = list(grads) if grads else [None] * expected
        flat_extras.extend(grads)
    flat_extras = [
        g if req else None for g, req in zip(flat_extras, call.extra_input_requires_grad)
    ]
    return (dx if call.input_requires_grad else None), flat_params, flat_extras


class OperationFuser:
    """Runs a list of fusible operations as one autograd function.

    Parameters
    ----------
    ops : sequence of FusibleOperation
        Fused operations among them (e.g. ``te.ops.Linear``) are flattened into their basic
        operations, which the registered fusions then regroup.

    Call it as ``fuser(input, *extra_inputs, basic_op_kwargs=None)``: returns the output, or
    ``(output, *extra_outputs)`` when some operation has extra outputs.
    """

    forward_backward_fusion_functions: list[Callable] = []
    forward_fusion_functions: list[Callable] = []
    backward_fusion_functions: list[Callable] = []

    def __init__(self, ops) -> None:
        basic_ops: list[BasicOp] = []
        for op in ops:
            # The operation classes run themselves through a fuser, so this file does not import
            # them: a fusible operation is recognised by its fuser interface.
            if not _is_fusible(op):
                raise TypeError(
                    f"OperationFuser runs fusible operations, got {type(op).__name__}; wrap "
                    "other modules in te.ops.Sequential, which runs them between fusers"
                )
            basic_ops.extend(op.basic_ops if op.is_fused_op else [op])
        if not basic_ops:
            raise ValueError("OperationFuser needs at least one operation")
        self._basic_ops = basic_ops
        self._num_extra_inputs = [op.num_extra_inputs for op in basic_ops]
        self._num_extra_outputs = [op.num_extra_outputs for op in basic_ops]
        self.num_extra_inputs = sum(self._num_extra_inputs)
        self.num_extra_outputs = sum(self._num_extra_outputs)
        self._forward_ops: list[tuple[FusibleOp, list[int]]] | None = None
        self._backward_ops: list[tuple[FusibleOp, list[int]]] | None = None
        self._fusion_key = None
        self._first_forward_done = False

    @property
    def basic_ops(self) -> list[BasicOp]:
        """The basic operations, in forward order."""
        return list(self._basic_ops)

    # -- fusion ----------------------------------------------------------------------------------
    def _apply_fusions(self, functions, recipe, ops=None) -> list[tuple[FusibleOp, list[int]]]:
        """Run ``functions`` over ``ops`` (default: the basic operations) and check the result
        still covers every basic operation once, in order."""
        ops = list(self._basic_ops) if ops is None else list(ops)
        for func in functions:
            ops = list(func(ops, recipe=recipe))
        planned, start = [], 0
        for op in ops:
            covered = list(op.basic_ops) if op.is_fused_op else [op]
            idxs = list(range(start, start + len(covered)))
            if idxs[-1] >= len(self._basic_ops) or any(
                c is not self._basic_ops[i] for c, i in zip(covered, idxs)
            ):
                raise RuntimeError(
                    "a fusion function changed the basic operations or their order; it must "
                    "only group consecutive operations into FusedOperations"
                )
            planned.append((op, idxs))
            start += len(covered)
        if start != len(self._basic_ops):
            raise RuntimeError("a fusion function dropped basic operations")
        return planned

    def maybe_fuse_ops(self, recipe, first_op_requiring_backward: int) -> None:
        """Recompute the fused forward and backward lists when the configuration changed."""
        key = (
            type(recipe),
            # the FP8 producer fusions apply only without backward_override: a plan made under
            # one value must not outlive a switch to another recipe of the same class
            getattr(recipe, "backward_override", None),
            first_op_requiring_backward,
            tuple(self.forward_backward_fusion_functions),
            tuple(self.forward_fusion_functions),
            tuple(self.backward_fusion_functions),
        )
        if key == self._fusion_key:
            return
        joint = self._apply_fusions(self.forward_backward_fusion_functions, recipe)
        joint_ops = [op for op, _ in joint]
        forward = self._apply_fusions(self.forward_fusion_functions, recipe, joint_ops)
        backward = self._apply_fusions(self.backward_fusion_functions, recipe, joint_ops)
        # a jointly fused operation must run both passes: its backward may need what only its
        # own forward saved
        for op in joint_ops:
            if op.is_fused_op and not (
                any(f is op for f, _ in forward) and any(b is op for b, _ in backward)
            ):
                raise RuntimeError(
                    f"a forward- or backward-only fusion absorbed {type(op).__name__}, which a "
                    "forward-backward fusion made; such fusions must pass fused operations "
                    "through unchanged"
                )
        self._forward_ops, self._backward_ops = forward, backward
        self._fusion_key = key

    # -- call ------------------------------------------------------------------------------------
    def _prepare_operations(self, device: torch.device, recipe) -> None:
        """Materialize meta parameters, make the recipe state, run the first-forward hooks."""
        for op in self._basic_ops:
            if op.has_meta_parameters():
                # never inference tensors as parameters, whatever mode the first call is in
                with torch.inference_mode(False):
                    op.reset_parameters(device=device)
        for op in self._basic_ops:
            op._reset_recipe_state_on(recipe, device)
        if not self._first_forward_done:
            for op in self._basic_ops:
                op.pre_first_fuser_forward()
            self._first_forward_done = True

    def _read_parameters(self, device: torch.device) -> list[list[torch.nn.Parameter]]:
        """The operations' current parameters (never cached), checked to be on ``device``."""
        params = [op.own_parameters() for op in self._basic_ops]
        for op, op_params in zip(self._basic_ops, params):
            for p in op_params:
                if p.device != device:
                    raise ValueError(
                        f"{type(op).__name__}: its parameters are on {p.device} but the input "
                        f"is on {device}; move the input to {p.device}, or the operation to "
                        f"{device} with .to(...)"
                    )
        return params

    def __call__(self, input: torch.Tensor, *extra_inputs: torch.Tensor, basic_op_kwargs=None):
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"the input must be a torch.Tensor, got {type(input).__name__}")
        if input.is_meta:
            raise ValueError(
                "the input is a meta tensor and holds no data; pass a real tensor (meta "
                "parameters are materialized onto the input's device)"
            )
        if len(extra_inputs) != self.num_extra_inputs:
            # name the operations that take them: "expected 1, got 0" alone did not say that
            # e.g. a GroupedLinear's split sizes were missing
            takers = [
                f"{type(op).__name__} ({count})"
                for op, count in zip(self._basic_ops, self._num_extra_inputs)
                if count
            ]
            hint = (
                f"they are taken, in order, by {', '.join(takers)} (e.g. a GroupedLinear's "
                "split sizes); pass them after the input"
                if takers
                else "no operation takes any; pass the input alone"
            )
            raise ValueError(
                f"expected {self.num_extra_inputs} extra inputs, got {len(extra_inputs)}: {hint}"
            )
        for i, extra in enumerate(extra_inputs):
            if not isinstance(extra, torch.Tensor):
                raise TypeError(
                    f"extra input {i} must be a torch.Tensor, got {type(extra).__name__}; e.g. "
                    "pass GroupedLinear's split sizes as torch.tensor([...]) (a CPU int64 tensor "
                    "avoids a device sync)"
                )
        count = len(self._basic_ops)
        if basic_op_kwargs is None:
            basic_op_kwargs = [{} for _ in range(count)]
        elif len(basic_op_kwargs) != count:
            raise ValueError(
                f"basic_op_kwargs has {len(basic_op_kwargs)} entries for {count} basic operations"
            )
        basic_op_kwargs = [kwargs or {} for kwargs in basic_op_kwargs]
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        recipe = FP8GlobalStateManager.get_fp8_recipe() if fp8 else None
        grad = torch.is_grad_enabled()
        state = FP8GlobalStateManager.quantization_state
        first_module_flag = state.is_first_fp8_module
        device = input.device
        with device_guard(device):
            swapped: list = []
            try:
                self._prepare_operations(device, recipe)
                if fp8:
                    swapped = _recompute_swap_in(self._basic_ops)
                params = self._read_parameters(device)
                extras = _split(extra_inputs, self._num_extra_inputs)
                first = count
                if grad:
                    for i in range(count):
                        if (
                            (i == 0 and input.requires_grad)
                            or any(p.requires_grad for p in params[i])
                            or any(t.requires_grad for t in extras[i])
                        ):
                            first = i
                            break
                self.maybe_fuse_ops(recipe, first)
                for i, op in enumerate(self._basic_ops):
                    op.pre_fuser_forward(requires_grad=i >= first)
                # Read again after every hook: autograd gets exactly the current parameters.
                params = self._read_parameters(device)
                flat_params = [p for op_params in params for p in op_params]
                call = _Call(
                    basic_ops=self._basic_ops,
                    forward_ops=self._forward_ops,
                    backward_ops=self._backward_ops,
                    basic_op_kwargs=basic_op_kwargs,
                    num_params=[len(p) for p in params],
                    num_extra_inputs=self._num_extra_inputs,
                    num_extra_outputs=self._num_extra_outputs,
                    first_op_requiring_backward=first,
                    backward_update=claim_backward_update() if fp8 and first < count else None,
                    input_requires_grad=grad and input.requires_grad,
                    param_requires_grad=tuple(p.requires_grad for p in flat_params),
                    extra_input_requires_grad=tuple(t.requires_grad for t in extra_inputs),
                )
                if grad:
                    output = _OperationFuserAutogradFunction.apply(
                        input, call, *flat_params, *extra_inputs
                    )
                else:
                    with torch.no_grad():
                        output = _fuser_forward(None, input, call, (*flat_params, *extra_inputs))
                if fp8 and not FP8GlobalStateManager.quantization_state.fp8_graph_capturing:
                    for op in self._basic_ops:
                        op.register_recipe_state()
            except BaseException:
                # leave the autocast region as it was: the first-module flag is handed back
                state.is_first_fp8_module = first_module_flag
                raise
            finally:
                _recompute_swap_out(swapped)
        return output


def _recompute_swap_in(ops) -> list:
    """Activation recompute (``te.checkpoint``) under delayed scaling, as the modules do it:
    the original forward stashes the scales and amax histories it casts with; the recompute,
    which runs in the backward after the autocast exit has updated them, casts with those
    again, so that the backward reads the forward's activations (it read others, quantized
    with the updated scales). Returns ``(state, up-to-date copy)`` pairs to put back."""
    stashing = is_fp8_activation_recompute_enabled()
    if not (stashing or in_fp8_activation_recompute_phase()):
        return []
    swapped = []
    for op in ops:
        state = op.recipe_state("forward")
        state = state.delayed_scaling_state() if state is not None else None
        if state is None:
            continue
        stash = op.__dict__.setdefault("_recompute_stash", [])
        if stashing:
            stash.append(state.snapshot())
        elif stash:
            swapped.append((state, state.snapshot()))
            state.restore(stash.pop(0))
    return swapped


def _recompute_swap_out(swapped: list) -> None:
    """After a recompute: the up-to-date scales and histories again (its amaxes dropped)."""
    for state, values in swapped:
        state.restore(values)


def _is_fusible(op) -> bool:
    """Whether ``op`` implements the fusible-operation interface (``te.ops.FusibleOperation``)."""
    return isinstance(op, torch.nn.Module) and all(
        hasattr(op, name) for name in ("is_fused_op", "fuser_forward", "fuser_backward")
    )


def register_forward_backward_fusion(func: Callable, prepend: bool = False) -> None:
    """Add a fusion ``func(ops, *, recipe) -> ops`` whose fused operations run both the forward
    and the backward (applied in registration order, before the forward-only and backward-only
    fusions)."""
    _register(OperationFuser.forward_backward_fusion_functions, func, prepend)


def register_forward_fusion(func: Callable, prepend: bool = False) -> None:
    """Add a forward fusion ``func(ops, *, recipe) -> ops`` (applied in registration order)."""
    _register(OperationFuser.forward_fusion_functions, func, prepend)


def register_backward_fusion(func: Callable, prepend: bool = False) -> None:
    """Add a backward fusion ``func(ops, *, recipe) -> ops`` (applied in registration order)."""
    _register(OperationFuser.backward_fusion_functions, func, prepend)


def _register(functions: list, func: Callable, prepend: bool) -> None:
    if not callable(func):
        raise TypeError(f"a fusion function must be callable, got {func!r}")
    if func in functions:
        return
    if prepend:
        functions.insert(0, func)
    else:
        functions.append(func)
