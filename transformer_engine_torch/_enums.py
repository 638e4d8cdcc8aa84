"""The enums and the metadata struct of upstream's extension module.

``DType`` is the package's own enum (:class:`transformer_engine.pytorch.constants.DType`): it
already has upstream's member names and integer values, so ``tex.DType`` and ``te.DType`` are
one class here and compare, hash and pickle alike. ``FP8FwdTensors`` / ``FP8BwdTensors`` are
the slot indices of a module's forward and backward scaling state (integers, usable as
indices into a scale vector or an amax-history row).
"""

from __future__ import annotations

import enum

from transformer_engine.pytorch.constants import DType

__all__ = ["DType", "FP8FwdTensors", "FP8BwdTensors", "FP8TensorMeta"]


class FP8FwdTensors(enum.IntEnum):
    """Forward scaling slots: input, weight and output of up to three GEMMs of one module."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """Backward scaling slots: gradient of the output and of the input of up to three GEMMs."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class FP8TensorMeta:
    """Holder of one direction's delayed-scaling tensors: ``scale``, ``scale_inv`` and
    ``amax_history``, each ``None`` until assigned.

    A plain record, like upstream's: nothing is validated or copied on assignment, and no
    other attribute can be set (a misspelled field raises ``AttributeError`` instead of
    silently creating a new one).
    """

    __slots__ = ("scale", "scale_inv", "amax_history")

    def __init__(self) -> None:
        self.scale = None
        self.scale_inv = None
        self.amax_history = None

    def __repr__(self) -> str:
        def describe(t):
            return "None" if t is None else f"tensor(shape={tuple(t.shape)}, device={t.device})"

        fields = ", ".join(f"{name}={describe(getattr(self, name))}" for name in self.__slots__)
        return f"FP8TensorMeta({fields})"
