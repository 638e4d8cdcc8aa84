"""``TransformerEngineBaseModule``: FP8 metadata, the forward device guard, deferred
initialization and checkpoints, shared by the linear modules.

Device rules (docs/architecture.md, the device contract):

* the forward runs with the *input's* device current (a guard stack in ``device.py``) and
  restores the caller's device on every exit, exceptions included;
* FP8 recipe state (scales, amax histories) lives on the device of the module's own parameters,
  follows ``module.to(...)``, and is restored there by ``load_state_dict`` whatever device wrote
  the checkpoint;
* ``device="meta"`` builds no storage; ``reset_parameters()`` materializes onto the device given
  to ``module.to_empty(device=...)``, else the current CUDA device, else the CPU.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch

from .._userbuffers import UserBufferQuantizationMode, destroy_ub, get_ub, initialize_ub
from ..device import construction_device, enter_device, exit_device, materialization_device
from ..distributed import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled
from ..extra_state import empty_extra_state, pack_extra_state, unpack_extra_state
from ..quantization import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    FP8GlobalStateManager,
    RecipeState,
)
from ..quantization.support import check_weight_recipe
from ..quantized_tensor import QuantizedTensor
from ..tensor.utils import QUANTIZED_TENSOR_ATTRIBUTES, attach_high_precision_init_val
from . import _fsdp_parameters as fsdp_parameters
from ._contiguous_parameters import group_views, repack_parameter_groups
from ._delayed_wgrad import DelayedWgrad

__all__ = ["TransformerEngineBaseModule", "resolve_module_device", "default_init_method"]
__all__ += ["initialize_ub", "destroy_ub", "get_ub", "UserBufferQuantizationMode"]


def resolve_module_device(device, owner: str = "module") -> torch.device:
    """The device a module is built on; kept for importers of this name, the rule itself is
    :func:`transformer_engine.pytorch.device.construction_device`."""
    return construction_device(owner, device)


def default_init_method(weight: torch.Tensor) -> None:
    """Upstream's default for the legacy modules: N(0, 0.023)."""
    torch.nn.init.normal_(weight, mean=0.0, std=0.023)


class TransformerEngineBaseModule(DelayedWgrad, torch.nn.Module):
    """Base of ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and ``GroupedLinear``."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.quantizers: dict[str, list] = {"scaling_fwd": [], "scaling_bwd": []}
        self.tp_group = None
        self.tp_size = 1
        self.tp_group_initialized = True  # tp_size 1 needs no group
        self.sequence_parallel = False
        # Attributes of parameters (tensor-parallel partitioning, sequence_parallel) that must
        # survive the Parameter objects being replaced (reset_parameters, to_empty).
        self._param_attributes: dict[str, dict[str, Any]] = {}
        self.fp8_parameters = FP8GlobalStateManager.with_fp8_parameters()
        self.primary_weights_in_fp8 = self.fp8_parameters
        self.preserve_high_precision_init_val = FP8GlobalStateManager.with_high_precision_init_val()
        self.param_init_meta: dict[str, tuple[Callable, int | None]] = {}
        self._fp8_workspaces: dict[str, Any] = {}
        self.activation_dtype: torch.dtype | None = None
        self._num_gemms = 1
        # the recipe FP8 parameters are quantized with (quantized_model_init's, if any)
        self._fp8_param_recipe = (
            FP8GlobalStateManager.get_fp8_recipe() if self.primary_weights_in_fp8 else None
        )

    # -- parameters and deferred initialization ----------------------------------------------
    def register_parameter(self, name, param, init_fn=None, fp8_meta_index=None) -> None:
        super().register_parameter(name, param)
        if name not in self.param_init_meta and param is not None:
            self.param_init_meta[name] = (init_fn, fp8_meta_index)

    def parameters_device(self) -> torch.device | None:
        """Device of the module's parameters (``None`` when it has none)."""
        for p in self._parameters.values():  # on the forward path: no generator machinery
            if p is not None:
                return p.device
        return None

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialize every parameter, materializing meta parameters first.

        Meta parameters go to the current CUDA device, else the CPU; parameters that already
        have storage (e.g. after ``module.to_empty(device=...)``) stay where they are. Under
        ``quantized_model_init`` the weights become FP8 parameters quantized on that device.
        """
        if defer_init:
            return fsdp_parameters.meta_fp8_parameters(self)
        target, device = materialization_device(), self.parameters_device()
        # DTensor shards (FSDP2) are written in place, whole values computed as unsharded.
        sharded = fsdp_parameters.reset_sharded_parameters(self)
        params = [(n, p) for n, p in self.named_parameters(recurse=False) if n not in sharded]
        # A split's parameters get their new storage as row ranges of one buffer.
        grouped = group_views(self, target if device is None or device.type == "meta" else device)
        # First every parameter in high precision, so the module has a device ...
        for name, param in params:
            init_fn = self.param_init_meta.get(name, (None, None))[0]
            device = param.device if param.device.type != "meta" else target
            values = grouped.get(name)
            if values is None or values.device != device:
                values = torch.empty(param.shape, dtype=param.dtype, device=device)
            with torch.no_grad(), self._rng_context():
                values.zero_() if init_fn is None else init_fn(values)
            self._replace_parameter(name, param, values)
        # ... then, under quantized_model_init, the weights become FP8 on that device.
        if self.primary_weights_in_fp8:
            for name, param in list(self.named_parameters(recurse=False)):
                index = self.param_init_meta.get(name, (None, None))[1]
                if index is None or name in sharded:
                    continue
                high_precision = param.detach().cpu().clone()
                self._replace_parameter(name, param, self._quantize_parameter(param.data, index))
                if self.preserve_high_precision_init_val:
                    attach_high_precision_init_val(getattr(self, name), high_precision)
        self._fp8_workspaces.clear()

    def _rng_context(self):
        """Upstream's ``get_rng_state_tracker``: initialize inside ``tracker.fork(name)``."""
        get_tracker = getattr(self, "get_rng_state_tracker", None)
        if get_tracker is None:
            return contextlib.nullcontext()
        tracker = get_tracker()
        name = getattr(self, "rng_tracker_name", None)
        return tracker.fork(name) if name else tracker.fork()

    def _replace_parameter(self, name: str, old: torch.nn.Parameter, values: torch.Tensor) -> None:
        new_param = torch.nn.Parameter(values, requires_grad=old.requires_grad)
        # Keep attributes such as sequence_parallel; not a quantized tensor's buffers.
        for attr, value in vars(old).items():
            if attr not in QUANTIZED_TENSOR_ATTRIBUTES:
                setattr(new_param, attr, value)
        setattr(self, name, new_param)

    def _quantize_parameter(self, values: torch.Tensor, fp8_meta_index: int) -> QuantizedTensor:
        self.init_fp8_metadata(self._num_gemms, force=True)
        quantizer = self.quantizers["scaling_fwd"][fp8_meta_index]
        quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())
        quantizer.internal = False  # a parameter must be a Float8Tensor
        with torch.no_grad():
            return quantizer.quantize_impl(values)

    # -- FP8 metadata --------------------------------------------------------------------------
    def init_fp8_metadata(self, num_gemms: int = 1, force: bool = False) -> None:
        """Create (or refresh) the recipe states of both directions on the module's device."""
        # Plain flags, set through __dict__: nn.Module.__setattr__ (which looks for parameters,
        # buffers and submodules first) costs host time on every forward.
        attrs = self.__dict__
        # The region's flags read off the state object once (what FP8GlobalStateManager's
        # getters return; every forward comes here).
        region = FP8GlobalStateManager.quantization_state
        fp8, calibrating = region.fp8_enabled, region.fp8_calibration
        attrs["_num_gemms"] = num_gemms
        attrs["fp8_parameters"] = self.fp8_parameters or region.fp8_parameters
        attrs["fp8"], attrs["fp8_calibration"] = fp8, calibrating
        self.fp8_meta["fp8_checkpoint"] = fp8 or calibrating
        if not (fp8 or calibrating or self.primary_weights_in_fp8 or force):
            attrs["fp8_initialized"] = False
            return
        if fp8 or calibrating or self._fp8_param_recipe is None:
            # (attention may follow a recipe of its own: NVTE_DPA_FP8_RECIPE)
            recipe = attrs.get("_recipe_override") or FP8GlobalStateManager.get_fp8_recipe()
            if fp8 and self.primary_weights_in_fp8:  # before anything is rebound to it
                check_weight_recipe(type(self).__name__, self._fp8_param_recipe, recipe)
        else:
            recipe = self._fp8_param_recipe
        device = self.parameters_device()
        if device is None or device.type == "meta":
            raise ValueError(
                f"{type(self).__name__} has no materialized parameters yet; call "
                "reset_parameters() or module.to_empty(device=...) before running it in FP8"
            )
        # fp8_meta["recipe"] is a copy taken when the state was built (recipes are mutable):
        # a recipe whose fields were assigned since compares unequal and rebuilds the state,
        # exactly as an equal new recipe object would.
        stored = self.fp8_meta.get("recipe")
        same = (
            self.fp8_meta_tensors_initialized
            and stored == recipe
            and self.fp8_meta["scaling_fwd"].device == device
            and self.fp8_meta["scaling_fwd"].num_quantizers == 3 * num_gemms
        )
        if not same:
            self._build_recipe_states(recipe, num_gemms, device)
        self.fp8_meta["fp8_group"] = region.fp8_distributed_group
        attrs["fp8_initialized"] = True

    def _build_recipe_states(self, recipe, num_gemms: int, device: torch.device) -> None:
        recipe = copy.copy(recipe)  # a snapshot: see init_fp8_metadata
        old_class = type(self.fp8_meta.get("recipe"))
        old_state = self.fp8_meta.get("scaling_fwd")
        if old_state is not None and old_state.device != device:
            # Parameters moved without _apply (e.g. accelerate swaps in new Parameters): cached
            # FP8 weights belong to the old device.
            self._fp8_workspaces.clear()
        for forward, count in ((True, 3 * num_gemms), (False, 2 * num_gemms)):
            key = FP8GlobalStateManager.get_meta_tensor_key(forward)
            mode = "forward" if forward else "backward"
            roles = self.get_quantizer_roles(fwd=forward, num_quantizers=count)
            state = RecipeState.create(
                recipe, mode=mode, num_quantizers=count, device=device, roles=roles
            )
            old = self.fp8_meta.get(key)
            if old is not None:
                state.inherit_state_from(old)
            self.fp8_meta[key] = state
            self.quantizers[key] = state.make_quantizers()
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["num_gemms"] = num_gemms
        self.fp8_meta["fp8_max_fwd"] = recipe.fp8_format.value.max_fwd
        self.fp8_meta["fp8_max_bwd"] = recipe.fp8_format.value.max_bwd
        self.fp8_meta_tensors_initialized = True
        if old_class is not type(recipe):
            self._fp8_workspaces.clear()
        self._rebind_fp8_parameter_quantizers()

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list | None:
        """The :class:`QuantizerRole` (or ``None`` for a boundary slot) of each of the
        ``num_quantizers`` slots of one direction; ``None``: the module declares none. Only a
        ``CustomRecipe`` factory reads them."""
        return None

    def _rebind_fp8_parameter_quantizers(self) -> None:
        fsdp_parameters.rebind_fp8_parameter_quantizers(self)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (needed before the forward when the module was
        built with ``tp_size > 1`` and no ``tp_group``)."""
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def __setstate__(self, state) -> None:  # deepcopy, unpickling: a split into one buffer
        super().__setstate__(state)
        repack_parameter_groups(self)
        # A copy's FP8 parameters re-quantize with the copy's own recipe state, not (deepcopy
        # shares the quantizer of a tensor) the original's; an unpickled one has none.
        if getattr(self, "fp8_meta_tensors_initialized", False):
            self._rebind_fp8_parameter_quantizers()

    def _apply(self, fn, *args, **kwargs):
        """Device moves carry the FP8 state along (values copied, never left behind)."""
        result = super()._apply(fn, *args, **kwargs)
        repack_parameter_groups(self)
        for name, attributes in self._param_attributes.items():
            param = self._parameters.get(name)
            if param is not None:  # a move may have made new Parameter objects
                for attr, value in attributes.items():
                    setattr(param, attr, value)
        device = self.parameters_device()
        state = self.fp8_meta.get("scaling_fwd")
        if state is not None and device is not None and state.device != device:
            self._fp8_workspaces.clear()
            if device.type == "meta":
                self.fp8_meta_tensors_initialized = False
            else:
                self._build_recipe_states(
                    self.fp8_meta["recipe"], self.fp8_meta["num_gemms"], device
                )
        return result

    def get_fp8_meta_tensors(self) -> dict | None:
        if not self.fp8_meta_tensors_initialized:
            return None
        out = {}
        for key in ("scaling_fwd", "scaling_bwd"):
            state = self.fp8_meta[key].delayed_scaling_state()
            if state is not None:
                out[key] = [state.scale.clone(), state.amax_history.clone()]
        return out or None

    def reset_fp8_meta_tensors(self, fp8_meta_tensors: dict | None = None) -> None:
        """Delayed-scaling scales back to 1 and amax histories to 0, or, given the dict
        :meth:`get_fp8_meta_tensors` returned, those values; in place, so quantizers and the
        amax registry keep pointing at the module's tensors. A dict without an entry for a
        direction changes nothing and raises ``KeyError``."""
        if not self.fp8_meta_tensors_initialized:
            return
        states = {}
        for forward in (True, False):
            key = FP8GlobalStateManager.get_meta_tensor_key(forward)
            state = self.fp8_meta[key].delayed_scaling_state()
            if state is not None:
                states[key] = state
        if fp8_meta_tensors is not None:
            missing = [key for key in states if key not in fp8_meta_tensors]
            if missing:
                raise KeyError(
                    f"reset_fp8_meta_tensors: no {missing[0]!r} entry in fp8_meta_tensors; pass "
                    "the dict get_fp8_meta_tensors() returned"
                )
        with torch.no_grad():
            for key, state in states.items():
                if fp8_meta_tensors is None:
                    state.scale.fill_(1.0)
                    state.amax_history.zero_()
                else:
                    scale, amax_history = fp8_meta_tensors[key]
                    state.scale.copy_(scale)
                    state.amax_history.copy_(amax_history)

    def adjust_amax_history_length(self, length: int, fwd: bool | None = None) -> None:
        """Truncate or zero-pad the delayed-scaling amax history of the forward (``fwd=True``),
        backward (``False``) or both (``None``) directions to ``length`` rows."""
        if not self.fp8_meta_tensors_initialized:
            return
        directions = (True, False) if fwd is None else (fwd,)
        for forward in directions:
            key = FP8GlobalStateManager.get_meta_tensor_key(forward)
            state = self.fp8_meta[key].delayed_scaling_state()
            if state is None:
                continue
            state.adjust_amax_history_length(length)
            # The quantizers hold views of the replaced history; the amax registry re-points
            # its entry at the module's next forward.
            self.quantizers[key] = self.fp8_meta[key].make_quantizers()
        self._fp8_workspaces.clear()
        self._rebind_fp8_parameter_quantizers()

    # -- forward -------------------------------------------------------------------------------
    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        if torch.is_autocast_enabled(inp.device.type):
            self.__dict__["activation_dtype"] = torch.get_autocast_dtype(inp.device.type)
            return
        dtype = inp.dtype
        for name, param in self._parameters.items():
            if param is not None and param.dtype != dtype:
                raise TypeError(
                    f"{type(self).__name__}: input dtype {dtype} does not match parameter "
                    f"{name!r} dtype {param.dtype}; cast the input (or the module) or run under "
                    "torch.autocast"
                )
        self.__dict__["activation_dtype"] = dtype  # a plain flag (see init_fp8_metadata)

    def _check_input(self, inp: torch.Tensor) -> None:
        device = self.parameters_device()
        if inp.is_meta and device is not None and device.type != "meta":
            raise ValueError(
                f"{type(self).__name__}: the input is a meta tensor but the module is on "
                f"{device}; pass a real tensor on {device}"
            )
        if device is not None and device.type == "meta":
            raise ValueError(
                f"{type(self).__name__} is on the meta device; call reset_parameters() or "
                "module.to_empty(device=...) first"
            )
        if device is not None and inp.device != device:
            raise ValueError(
                f"{type(self).__name__}: the input is on {inp.device} but the module's parameters "
                f"are on {device}; move the input to {device}"
            )

    def _check_fp8_parameters(self) -> None:
        """Under ``quantized_model_init`` the weights must still be FP8 tensors when the module
        runs (FSDP2 keeps dim-0 shards of per-tensor ones so: ``tensor/_float8_fsdp.py``);
        high-precision values left by anything else would train silently in another
        precision, without the module's scaling state."""
        for name, (_, index) in self.param_init_meta.items():
            param = self._parameters.get(name)
            if index is None or param is None or isinstance(param, QuantizedTensor):
                continue
            kind = type(param).__name__
            local = getattr(param, "_local_tensor", None)  # a DTensor shard
            if local is not None:
                kind = f"a {kind} shard of {type(local).__name__}"
            raise NotImplementedError(
                f"{type(self).__name__}: parameter {name!r} was created as an FP8 tensor by "
                f"te.quantized_model_init but is now {kind} ({param.dtype}): it was replaced by "
                "high-precision values, e.g. by assigning a plain tensor, or by FSDP2's "
                "fully_shard, which all-gathers per-tensor FP8 weights (DelayedScaling, "
                "Float8CurrentScaling) sharded along dim 0 only (give this parameter Shard(0) "
                "in shard_placement_fn) and has no FP8 all-gather for block-scaled ones (MXFP8, "
                "Float8BlockScaling, NVFP4). Keep it an FP8 tensor, or build the model without "
                "quantized_model_init (FP8 compute still comes from te.autocast)"
            )

    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1, allow_non_contiguous=False):
        """Enter the input's device and initialize FP8 metadata; pair with :meth:`end_forward`."""
        self._check_input(inp)
        if self.primary_weights_in_fp8:
            self._check_fp8_parameters()
        enter_device(inp.device)
        try:
            self.set_activation_dtype(inp)
            self.init_fp8_metadata(num_gemms)
            self._recompute_swap_in()
            if not allow_non_contiguous and not isinstance(inp, QuantizedTensor):
                inp = inp.contiguous()
            return inp
        except BaseException:
            exit_device()
            raise

    def end_forward(self) -> None:
        try:
            self._recompute_swap_out()
        finally:
            exit_device()

    # -- activation recompute (te.checkpoint) ----------------------------------------------------
    def _delayed_forward_state(self):
        state = self.fp8_meta.get("scaling_fwd")
        if self.fp8 and isinstance(state, RecipeState):
            return state.delayed_scaling_state()
        return None

    def _recompute_swap_in(self) -> None:
        """Original forward: stash the scales it casts with; recompute: cast with them again."""

        state = self._delayed_forward_state()
        if state is None:
            return
        stash = self.__dict__.setdefault("_recompute_stash", [])
        if is_fp8_activation_recompute_enabled():
            stash.append(state.snapshot())
        elif in_fp8_activation_recompute_phase() and stash:
            self._recompute_updated = state.snapshot()
            state.restore(stash.pop(0))

    def _recompute_swap_out(self) -> None:
        """After a recompute: back to the up-to-date values (dropping the recompute's amaxes)."""
        updated = self.__dict__.pop("_recompute_updated", None)
        state = self._delayed_forward_state()
        if updated is not None and state is not None:
            state.restore(updated)

    def _register_fp8_state(self) -> None:
        """Put the delayed-scaling state into the amax registry (after a successful forward)."""
        # either direction may hold it (a CustomRecipe may request delayed scaling for its
        # backward slots only)
        if self.fp8 and any(
            isinstance(state, RecipeState) and state.delayed_scaling_state()
            for state in (self.fp8_meta.get("scaling_fwd"), self.fp8_meta.get("scaling_bwd"))
        ):
            if not FP8GlobalStateManager.quantization_state.fp8_graph_capturing:
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)

    def prepare_forward_ctx(self, inp, num_gemms: int = 1, allow_non_contiguous=False):
        """``with module.prepare_forward_ctx(inp) as inp:`` runs a forward between
        :meth:`prepare_forward` and :meth:`end_forward`; after a forward that completes, the
        module's delayed-scaling state joins the amax registry."""
        return _ForwardRegion(self, inp, num_gemms, allow_non_contiguous)

    def _check_save_original_input(self) -> None:
        """``save_original_input=True`` re-quantizes the saved input in backward: refused under a
        recipe whose scale changes between forward and backward (delayed scaling)."""
        state = self.fp8_meta.get("scaling_fwd")
        if self.fp8_meta["recipe"].delayed() or (state and state.delayed_scaling_state()):
            raise ValueError(
                f"{type(self).__name__}: save_original_input=True re-quantizes the input in "
                "backward, which is only exact for stateless recipes; DelayedScaling's scale "
                "changes between forward and backward. Use Float8CurrentScaling or "
                "save_original_input=False"
            )

    # -- checkpoints ---------------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """The module's delayed-scaling state as a ``torch.uint8`` tensor of bytes
        (``extra_state.pack_extra_state``; no pickle); an empty one without such state."""
        state = self.fp8_meta.get("scaling_fwd")
        if not (self.fp8_meta.get("fp8_checkpoint") or self.primary_weights_in_fp8):
            return empty_extra_state()
        if isinstance(state, CustomRecipeState):
            backward = self.fp8_meta.get("scaling_bwd")
            if state.delayed_scaling_state() is None and backward.delayed_scaling_state() is None:
                return empty_extra_state()  # every quantizer came from the factory
            raise NotImplementedError(
                f"{type(self).__name__}: saving a checkpoint of a module run under a "
                "CustomRecipe whose factory returned DelayedScalingRequests is not supported "
                "(the recipe's factory cannot be stored); save under DelayedScaling, or leave "
                "the module out of FP8 (autocast(enabled=False)) before state_dict()"
            )
        if not isinstance(state, DelayedScalingRecipeState):
            return empty_extra_state()
        tensors = {
            "scale_fwd": state.scale,
            "amax_history_fwd": state.amax_history,
            "scale_bwd": self.fp8_meta["scaling_bwd"].scale,
            "amax_history_bwd": self.fp8_meta["scaling_bwd"].amax_history,
        }
        extra = {"num_gemms": self.fp8_meta.get("num_gemms", self._num_gemms)}
        return pack_extra_state(self.fp8_meta["recipe"], tensors, extra)

    def set_extra_state(self, state) -> None:
        device = self.parameters_device()
        if device is None or device.type == "meta":
            device = torch.device("cpu") if device is None else device
        unpacked = unpack_extra_state(state, device=device)
        if unpacked is None:
            return
        recipe, tensors, extra = unpacked
        num_gemms = int(extra.get("num_gemms", self._num_gemms))
        self._check_extra_state_layout(num_gemms, tensors)
        if device.type == "meta":
            return  # nothing to hold the values yet; they arrive with the next load
        self._build_recipe_states(recipe, num_gemms, device)
        with torch.no_grad():
            for key, suffix in (("scaling_fwd", "fwd"), ("scaling_bwd", "bwd")):
                st = self.fp8_meta[key]
                if f"scale_{suffix}" in tensors:
                    st.scale.copy_(tensors[f"scale_{suffix}"])
                    history = tensors[f"amax_history_{suffix}"]
                    if history.shape != st.amax_history.shape:
                        st.amax_history = history.to(device).clone()
                        self.quantizers[key] = st.make_quantizers()
                    else:
                        st.amax_history.copy_(history)
        self.fp8_meta["fp8_checkpoint"] = True
        self._rebind_fp8_parameter_quantizers()

    def _check_extra_state_layout(self, num_gemms: int, tensors: dict) -> None:
        """Refuse, before anything changes, state saved by a module with another GEMM count
        (3 forward and 2 backward quantizers per GEMM)."""
        counts = {f"scale_{d}": k * num_gemms for d, k in (("fwd", 3), ("bwd", 2))}
        found = {name: tensors[name].shape[0] for name in counts if name in tensors}
        if any(found[name] != counts[name] for name in found):
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's extra state says num_gemms="
                f"{num_gemms} but holds {found} quantizer scales (expected {counts}: 3 forward "
                f"and 2 backward per GEMM); the checkpoint is inconsistent"
            )
        if num_gemms != self._num_gemms:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's extra state was saved by a module "
                f"with {num_gemms} GEMM(s), but this module has {self._num_gemms}; load it into "
                f"a module of the same layout (e.g. the same num_gemms of a GroupedLinear)"
            )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args, **kwargs):
        # FP8 weights must be re-quantized with the checkpoint's scales: load them first.
        key = prefix + torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX
        if self.primary_weights_in_fp8 and key in state_dict:
            self.set_extra_state(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args, **kwargs)


class _ForwardRegion:
    """The context manager of :meth:`TransformerEngineBaseModule.prepare_forward_ctx` (a class:
    every forward enters one, and a generator context manager cost several times more host
    time)."""

    __slots__ = ("module", "inp", "num_gemms", "allow_non_contiguous", "first_flag")

    def __init__(self, module, inp, num_gemms: int, allow_non_contiguous) -> None:
        self.module, self.inp = module, inp
        self.num_gemms, self.allow_non_contiguous = num_gemms, allow_non_contiguous

    def __enter__(self):
        self.first_flag = FP8GlobalStateManager.quantization_state.is_first_fp8_module
        inp = self.module.prepare_forward(self.inp, self.num_gemms, self.allow_non_contiguous)
        self.inp = None  # not kept alive by the region
        return inp

    def __exit__(self, exc_type, exc, tb) -> None:
        module = self.module
        try:
            if exc_type is None:
                module._register_fp8_state()
            else:
                # leave the region as it was: the first-module flag is handed back
                FP8GlobalStateManager.quantization_state.is_first_fp8_module = self.first_flag
        finally:
            module.end_forward()
