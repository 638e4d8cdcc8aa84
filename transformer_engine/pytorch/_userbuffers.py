"""Upstream's userbuffers interface to communication/GEMM overlap: ``initialize_ub``,
``destroy_ub``, ``get_ub``, ``UserBufferQuantizationMode``, and the overlaps a module's ``ub_*``
flags ask for.

Upstream's userbuffers move tensor-parallel activations through buffers of its own, registered
with every rank of the node, so that a GEMM can run chunk by chunk while the next chunk arrives.
This package pipelines the same GEMMs with ``torch.distributed`` point-to-point transfers over
the module's tensor-parallel group (:mod:`._ring_gemm`): nothing is allocated up front and any
backend that has ``isend`` / ``irecv`` (NCCL, gloo) carries it. ``initialize_ub`` therefore only
records the configuration the modules check against: the tensor-parallel size and, per GEMM
(``qkv_fprop``, ``fc2_dgrad``, ...), the ``ub_cfgs`` options, which select nothing here (the
pipelines are described in docs/modules.md, "Communication overlap").
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "UserBufferQuantizationMode",
    "initialize_ub",
    "destroy_ub",
    "get_ub",
    "is_ub_initialized",
    "CommOverlapFlags",
    "comm_overlap_flags",
    "check_comm_overlap_ready",
]

# Upstream's layer names (``ub_name``) and the three GEMMs of each
LAYER_NAMES = ("qkv", "proj", "fc1", "fc2")
GEMMS = ("fprop", "dgrad", "wgrad")
METHODS = ("ring_exchange", "pipeline", "bulk")
BOOTSTRAP_BACKENDS = (None, "mpi", "nccl", "gloo")


class UserBufferQuantizationMode(enum.Enum):
    """Whether a userbuffers communicator carries high-precision (``NONE``) or FP8 (``FP8``)
    activations. Here the pipelines move FP8 bytes whenever the module's recipe casts the
    gathered operand with a per-tensor FP8 scale, whatever the mode."""

    NONE = "none"
    FP8 = "fp8"


@dataclasses.dataclass(frozen=True)
class GemmOverlapConfig:
    """What ``initialize_ub`` recorded for one GEMM (``name`` such as ``"fc1_fprop"``):
    ``method`` and the other ``ub_cfgs`` options as given (``options``)."""

    name: str
    method: str
    options: dict


@dataclasses.dataclass(frozen=True)
class _Registry:
    shape: tuple[int, int]
    tp_size: int
    dtype: torch.dtype
    quantization_modes: tuple[UserBufferQuantizationMode, ...]
    gemms: dict[str, GemmOverlapConfig]


_REGISTRY: _Registry | None = None


def _default_method(gemm: str) -> str:
    # upstream's defaults: the forward all-gathers (and the row layers' dgrad gathers) run as a
    # ring exchange, the row layers' forward reduce-scatters as a pipeline, the column layers'
    # backward collectives in bulk
    if gemm in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"):
        return "ring_exchange"
    if gemm in ("proj_fprop", "fc2_fprop"):
        return "pipeline"
    return "bulk"


def _quantization_modes(use_fp8, quantization_modes) -> tuple[UserBufferQuantizationMode, ...]:
    if quantization_modes is None:
        mode = UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE
        return (mode,)
    modes = quantization_modes
    if isinstance(modes, (UserBufferQuantizationMode, str)):
        modes = [modes]
    try:
        return tuple(UserBufferQuantizationMode(m) for m in modes)
    except (TypeError, ValueError):
        raise ValueError(
            f"initialize_ub: quantization_modes={quantization_modes!r} must be a list of "
            "UserBufferQuantizationMode (NONE or FP8)"
        ) from None


def _gemm_configs(ub_cfgs) -> dict[str, GemmOverlapConfig]:
    if ub_cfgs is None:
        ub_cfgs = {}
    elif isinstance(ub_cfgs, (list, tuple)):  # one dict per quantization mode: merged
        merged = {}
        for cfg in ub_cfgs:
            merged.update(cfg or {})
        ub_cfgs = merged
    if not isinstance(ub_cfgs, dict):
        raise TypeError(f"initialize_ub: ub_cfgs={ub_cfgs!r} must be a dict of per-GEMM dicts")
    names = [f"{layer}_{gemm}" for layer in LAYER_NAMES for gemm in GEMMS]
    names += [n for n in ub_cfgs if n not in names]
    configs = {}
    for name in names:
        options = dict(ub_cfgs.get(name) or {})
        layer, _, gemm = name.rpartition("_")
        if not layer or gemm not in GEMMS:
            raise ValueError(
                f"initialize_ub: ub_cfgs key {name!r} must name a GEMM as '<layer>_<fprop|"
                "dgrad|wgrad>' (for instance 'qkv_fprop' or 'fc2_dgrad')"
            )
        method = options.pop("method", _default_method(name))
        if method not in METHODS:
            raise ValueError(
                f"initialize_ub: ub_cfgs[{name!r}]['method']={method!r} must be one of {METHODS}"
            )
        configs[name] = GemmOverlapConfig(name, method, options)
    return configs


def initialize_ub(
    shape: list | tuple,
    tp_size: int,
    use_fp8: bool = False,
    quantization_modes=None,
    dtype: torch.dtype = torch.bfloat16,
    ub_cfgs: dict | list | None = None,
    bootstrap_backend: str | None = None,
    with_cublasmp: bool = False,
) -> None:
    """Set up communication/GEMM overlap for modules built with ``ub_*`` flags and ``ub_name``.

    ``shape``: ``(sequence * batch, hidden)`` of the activations (upstream sizes its buffers
    from it; the pipelines here allocate per call and take any token count the group divides);
    ``tp_size``: the tensor-parallel size, which every overlapping module's group must have;
    ``use_fp8`` (deprecated) / ``quantization_modes``: recorded; ``ub_cfgs``: per-GEMM options
    (``{"fc1_fprop": {"method": "ring_exchange", ...}}``, or a list with one dict per mode),
    validated and recorded; ``bootstrap_backend`` and ``with_cublasmp`` choose how upstream sets
    up its buffers and are accepted. ``torch.distributed`` must be initialized. Call
    :func:`destroy_ub` before calling it again."""
    global _REGISTRY
    del with_cublasmp  # the pipelines use the process group's own transfers either way
    if _REGISTRY is not None:
        raise RuntimeError(
            "initialize_ub: communication overlap is already initialized; call destroy_ub() "
            "first to set it up again"
        )
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            "initialize_ub: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first"
        )
    if (
        not isinstance(shape, (list, tuple, torch.Size))
        or len(shape) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)
    ):
        raise ValueError(
            f"initialize_ub: shape={shape!r} must be (sequence * batch, hidden), two positive ints"
        )
    world = torch.distributed.get_world_size()
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"initialize_ub: tp_size={tp_size!r} must be a positive int")
    if world % tp_size:
        raise ValueError(
            f"initialize_ub: tp_size={tp_size} does not divide the world size ({world})"
        )
    if shape[0] % tp_size:
        raise ValueError(
            f"initialize_ub: shape[0]={shape[0]} (sequence * batch) must be a multiple of "
            f"tp_size={tp_size}: sequence parallelism splits it over the ranks"
        )
    if bootstrap_backend not in BOOTSTRAP_BACKENDS:
        raise ValueError(
            f"initialize_ub: bootstrap_backend={bootstrap_backend!r} must be one of "
            f"{BOOTSTRAP_BACKENDS}"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"initialize_ub: dtype={dtype!r} must be a torch.dtype")
    _REGISTRY = _Registry(
        shape=(shape[0], shape[1]),
        tp_size=tp_size,
        dtype=dtype,
        quantization_modes=_quantization_modes(use_fp8, quantization_modes),
        gemms=_gemm_configs(ub_cfgs),
    )


def destroy_ub() -> None:
    """Forget what :func:`initialize_ub` set up (modules with ``ub_*`` flags refuse to run
    until it is called again)."""
    global _REGISTRY
    _REGISTRY = None


def is_ub_initialized() -> bool:
    """Whether :func:`initialize_ub` has been called (and not undone by :func:`destroy_ub`)."""
    return _REGISTRY is not None


def get_ub(name: str) -> GemmOverlapConfig:
    """The configuration :func:`initialize_ub` recorded for GEMM ``name`` (``"fc1_fprop"``)."""
    if _REGISTRY is None:
        raise RuntimeError(f"get_ub({name!r}): call initialize_ub(...) first")
    try:
        return _REGISTRY.gemms[name]
    except KeyError:
        raise KeyError(
            f"get_ub: no GEMM named {name!r}; known: {sorted(_REGISTRY.gemms)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CommOverlapFlags:
    """Which of a tensor-parallel GEMM's collectives run pipelined with it (see
    :mod:`._ring_gemm`): ``ag_fprop`` the column-parallel forward's input all-gather,
    ``rs_fprop`` the row-parallel forward's output reduce-scatter, ``rs_dgrad`` the
    column-parallel backward's input-gradient reduce-scatter, ``ag_dgrad`` the row-parallel
    backward's output-gradient all-gather. ``name``: the layer's ``ub_name``."""

    name: str
    ag_fprop: bool = False
    rs_fprop: bool = False
    rs_dgrad: bool = False
    ag_dgrad: bool = False


def comm_overlap_flags(
    owner: str,
    *,
    parallel_mode: str | None,
    sequence_parallel: bool,
    ub_overlap_ag: bool = False,
    ub_overlap_rs: bool = False,
    ub_overlap_rs_dgrad: bool = False,
    ub_bulk_dgrad: bool = False,
    ub_bulk_wgrad: bool = False,
    ub_name: str | None = None,
) -> CommOverlapFlags | None:
    """A module's ``ub_*`` arguments as upstream reads them: they act only on a tensor-parallel
    layer under sequence parallelism; ``ub_overlap_ag`` pipelines a column layer's forward
    gather and a row layer's backward gather, ``ub_overlap_rs`` a row layer's forward
    reduce-scatter, ``ub_overlap_rs_dgrad`` a column layer's backward reduce-scatter;
    ``ub_bulk_dgrad`` / ``ub_bulk_wgrad`` (the column layer's backward gather and
    reduce-scatter run behind its GEMMs) are what every column-parallel backward here does
    already. ``None`` when nothing is pipelined. Any flag set needs ``ub_name``.
    ``parallel_mode="mlp"``: a column-parallel GEMM followed by a row-parallel one
    (``LayerNormMLP``: ``fc1`` and ``fc2``), both read from the same flags."""
    flags = (ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad)
    if any(flags) and not ub_name:
        raise ValueError(
            f"{owner}: the ub_* communication overlap flags need ub_name (the layer's name in "
            f"initialize_ub's configuration, one of {LAYER_NAMES})"
        )
    if not sequence_parallel or parallel_mode not in ("column", "row", "mlp"):
        return None
    column, row = parallel_mode in ("column", "mlp"), parallel_mode in ("row", "mlp")
    overlap = CommOverlapFlags(
        name=ub_name or "",
        ag_fprop=column and bool(ub_overlap_ag),
        rs_fprop=row and bool(ub_overlap_rs),
        rs_dgrad=column and bool(ub_overlap_rs_dgrad),
        ag_dgrad=row and bool(ub_overlap_ag),
    )
    if not (overlap.ag_fprop or overlap.rs_fprop or overlap.rs_dgrad or overlap.ag_dgrad):
        return None
    return overlap


def check_comm_overlap_ready(owner: str, overlap: CommOverlapFlags | None, tp_size: int) -> None:
    """Before a forward that pipelines its collectives: :func:`initialize_ub` must have been
    called with this layer's ``tp_size`` and know its ``ub_name``."""
    if overlap is None:
        return
    if _REGISTRY is None:
        raise RuntimeError(
            f"{owner}: ub_name={overlap.name!r} asks for communication overlap; call "
            "transformer_engine.pytorch.initialize_ub(shape, tp_size, ...) before the forward"
        )
    if _REGISTRY.tp_size != tp_size:
        raise RuntimeError(
            f"{owner}: the layer's tensor-parallel size is {tp_size} but initialize_ub was "
            f"called with tp_size={_REGISTRY.tp_size}"
        )
    if f"{overlap.name}_fprop" not in _REGISTRY.gemms:
        known = sorted({n.rpartition("_")[0] for n in _REGISTRY.gemms})
        raise RuntimeError(
            f"{owner}: ub_name={overlap.name!r} is not a layer initialize_ub knows ({known}); "
            "use one of them or name it in ub_cfgs"
        )
