"""Activation recompute (``te.checkpoint`` / ``te.distributed.checkpoint``) that keeps
delayed-scaling FP8 state consistent.

A recomputed forward must cast exactly like the original forward, although the scales may
have been updated in between (at the autocast exit). So, inside a checkpointed region:

* the original forward of each FP8 module stashes a copy of its forward scale and amax history
  (a FIFO per module, for regions that call a module several times);
* the recompute swaps the stashed values in, runs, and then puts the up-to-date values back,
  which also discards the amaxes the recompute accumulated (no amax is registered twice);
* the recompute runs under the autocast state captured when the region first ran;
* with ``get_rng_state_tracker``, the recompute forks the tracker's states as they were when
  the region first ran (dropout inside ``tracker.fork()`` draws the same masks again).

Also ``CudaRNGStatesTracker``: named RNG streams, each forked in for a region (Megatron-style
model-parallel RNG).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from ._distributed_checkpoint import distributed_checkpoint
from ._tensor_parallel import (  # noqa: F401  (upstream's te.distributed helpers)
    allreduce,
    gather_along_first_dim,
    get_distributed_rank,
    get_distributed_world_size,
    initialize_affine_weight_gpu,
    reduce_scatter_along_first_dim,
    set_tensor_model_parallel_attributes,
)
from .quantization import FP8GlobalStateManager

# upstream's __all__; the other public names (the recompute phase flags, the collectives and
# helpers below) are imported by name
__all__ = ["checkpoint", "CudaRNGStatesTracker"]

_local = threading.local()


def _phase() -> str | None:
    return getattr(_local, "phase", None)


@contextlib.contextmanager
def _in_phase(phase: str):
    previous = _phase()
    _local.phase = phase
    try:
        yield
    finally:
        _local.phase = previous


def is_fp8_activation_recompute_enabled() -> bool:
    """Inside the original forward of a checkpointed region, with FP8 enabled."""
    return _phase() == "forward" and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase() -> bool:
    """Inside the recompute (during backward) of a checkpointed region."""
    return _phase() == "recompute"


def checkpoint(
    function: Callable,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Callable | None = None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in
    backward with the same FP8 scales as the original forward.

    Parameters
    ----------
    function : callable
    distribute_saved_activations : bool, default False
        Keep only this rank's ``1 / tp_size`` share of the first tensor argument (the same on
        every rank of ``tp_group``: tensor parallelism without sequence parallelism) between
        forward and backward: its data is replaced by this rank's chunk after the forward and
        all-gathered over ``tp_group`` before the recompute (the caller must not read it in
        between). No effect without ``tp_group`` or with one rank. Needs
        ``use_reentrant=True``.
    get_rng_state_tracker : callable, optional
        Returns a :class:`CudaRNGStatesTracker`: the recompute runs with the tracker's states
        of the original forward, which are put back afterwards. The default CPU and CUDA RNG
        states are preserved by torch's checkpoint either way.
    tp_group : ProcessGroup, optional
        The tensor-parallel group ``distribute_saved_activations`` splits over.
    use_reentrant : bool, default True
        Passed to ``torch.utils.checkpoint.checkpoint``.
    context_fn, determinism_check, debug
        Passed to ``torch.utils.checkpoint.checkpoint`` when given (not to ``function``).

    The deprecated form ``checkpoint(function, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *args)`` is still accepted, with a ``DeprecationWarning``.
    """
    args, distribute_saved_activations, get_rng_state_tracker, tp_group = (
        _split_deprecated_positional_arguments(
            args, distribute_saved_activations, get_rng_state_tracker, tp_group
        )
    )
    # torch's own checkpoint options are not arguments of ``function``.
    torch_checkpoint_options = {
        name: kwargs.pop(name) for name in _TORCH_CHECKPOINT_OPTIONS if name in kwargs
    }
    distribute = (
        distribute_saved_activations
        and tp_group is not None
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size(tp_group) > 1
    )
    if distribute and not use_reentrant:
        raise ValueError(
            "checkpoint: distribute_saved_activations=True recomputes through a reentrant "
            "autograd function; pass use_reentrant=True (the default)"
        )
    if not torch.is_grad_enabled():
        # Nothing to recompute: no graph is recorded. Entering the forward phase here would make
        # every module stash its scales for a recompute that never comes (an evaluation loop
        # through checkpointed layers grew those stashes by one entry per call).
        return function(*args, **kwargs)
    calls = {"count": 0}
    autocast_state = FP8GlobalStateManager.get_autocast_state()
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    forward_rng_states = {}

    def run(*inner_args):
        calls["count"] += 1
        if calls["count"] == 1:
            if tracker is not None:
                forward_rng_states.update(_copy_rng_states(tracker.get_states()))
            with _in_phase("forward"):
                return function(*inner_args, **kwargs)
        saved = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.set_autocast_state(autocast_state)
        if tracker is not None:
            rng_states_now = tracker.get_states()
            tracker.set_states(_copy_rng_states(forward_rng_states))
        try:
            with _in_phase("recompute"):
                return function(*inner_args, **kwargs)
        finally:
            FP8GlobalStateManager.set_autocast_state(saved)
            if tracker is not None:
                tracker.set_states(rng_states_now)

    if distribute:
        return distributed_checkpoint(run, args, tp_group)
    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=use_reentrant, **torch_checkpoint_options
    )


_TORCH_CHECKPOINT_OPTIONS = ("context_fn", "determinism_check", "debug")


def _split_deprecated_positional_arguments(
    args: tuple, distribute_saved_activations, get_rng_state_tracker, tp_group
):
    """Recognize upstream's old call form ``checkpoint(function, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *args)`` by the test upstream applies (more than three
    positional arguments, a bool, a callable, then ``None`` or a process group), so code written
    against older TE releases keeps running; otherwise return the arguments unchanged."""
    group_types = (type(None),)
    if torch.distributed.is_available():
        group_types += (torch.distributed.ProcessGroup,)
    if not (
        len(args) > 3
        and isinstance(args[0], bool)
        and callable(args[1])
        and isinstance(args[2], group_types)
    ):
        return args, distribute_saved_activations, get_rng_state_tracker, tp_group
    warnings.warn(
        "Passing distribute_saved_activations, get_rng_state_tracker and tp_group positionally "
        "to checkpoint is deprecated; pass them as keyword arguments",
        DeprecationWarning,
        stacklevel=3,
    )
    return args[3:], args[0], args[1], args[2]


# ---------------------------------------------------------------------------------------------
# Named RNG streams.
#
# The tracked generator is the default generator of the current CUDA device when CUDA is
# available, else the CPU's default generator (so the tracker works, and tests run, on CPU-only
# machines). A state is a generator-state object where torch supports graph-safe generator
# states on CUDA (it advances in place and CUDA graphs can register it), else a ByteTensor from
# ``Generator.get_state()``; fork accepts either kind, e.g. states restored by set_states.

_ALL_ACTIVE_RNG_STATES: dict = {}


def graph_safe_rng_available() -> bool:
    """Whether torch has graph-safe generator states (CUDA graphs can capture forked RNG)."""
    return (
        hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        and hasattr(torch.Generator, "graphsafe_set_state")
        and hasattr(torch.Generator, "graphsafe_get_state")
        and hasattr(torch.Generator, "clone_state")
    )


def get_all_rng_states() -> dict:
    """The states of the last tracker that added one (what CUDA graph capture registers)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: dict) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


def _tracked_generator() -> torch.Generator:
    if torch.cuda.is_available():
        torch.cuda.init()  # fills torch.cuda.default_generators
        return torch.cuda.default_generators[torch.cuda.current_device()]
    return torch.default_generator


def _uses_state_objects(generator: torch.Generator) -> bool:
    return generator.device.type == "cuda" and graph_safe_rng_available()


def _get_state(generator: torch.Generator, like):
    if isinstance(like, torch.Generator):
        return generator.graphsafe_get_state()
    return generator.get_state()


def _set_state(generator: torch.Generator, state) -> None:
    if isinstance(state, torch.Generator):
        generator.graphsafe_set_state(state)
    else:
        generator.set_state(state)


def _copy_rng_states(states: dict) -> dict:
    """Independent copies: a state object advances in place while it is forked in."""
    return {
        name: state.clone_state() if isinstance(state, torch.Generator) else state.clone()
        for name, state in states.items()
    }


class CudaRNGStatesTracker:
    """Named RNG states, each seeded once and forked in for a region.

    ``add(name, seed)`` creates a state seeded with ``seed`` without touching the current RNG;
    ``with tracker.fork(name):`` runs the region with that state (it continues where the last
    fork of ``name`` left off) and restores the previous state on exit. Model-parallel code
    forks a per-rank stream for weight initialization and dropout, so tensor-parallel shards
    differ while everything else stays in step.

    The states belong to the default generator of the CUDA device that is current when
    ``add``/``fork`` run (wrap them in ``torch.cuda.device(i)`` for another GPU); without CUDA,
    to the CPU's default generator.
    """

    def __init__(self) -> None:
        self.states_: dict = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict:
        """A new dict of the current states, to hand to :meth:`set_states` later.

        State objects (graph-safe CUDA states) advance in place while forked in, so they are
        copied; ByteTensor states are replaced, never modified, and are shared."""
        return {
            name: state.clone_state() if isinstance(state, torch.Generator) else state
            for name, state in self.states_.items()
        }

    def set_states(self, states: dict) -> None:
        """Replace the states (e.g. with a dict from :meth:`get_states`); not checked."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Add state ``name`` seeded with ``seed``; a seed or name used before is refused
        (``RuntimeError``)."""
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        generator = _tracked_generator()
        if _uses_state_objects(generator):
            state = generator.clone_state()
            state.manual_seed(seed)
        else:
            state = torch.Generator(device=generator.device).manual_seed(seed).get_state()
        self.states_[name] = state
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the region with state ``name`` (``KeyError`` if it was never added)."""
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        generator = _tracked_generator()
        state = self.states_[name]
        original = _get_state(generator, state)
        _set_state(generator, state)
        try:
            yield
        finally:
            self.states_[name] = _get_state(generator, state)
            _set_state(generator, original)
