"""The :class:`QuantizerRole` of each quantizer slot of the GEMM modules.

Slots follow upstream's positional layout: per GEMM, forward ``[input, weight, output]`` and
backward ``[grad_output, grad_input]``. The output and grad-input slots are the module's
boundaries (what its neighbour consumes), so their role is ``None``: a ``CustomRecipe``
factory is asked with ``None`` there. Only ``CustomRecipe`` reads roles.
"""

from __future__ import annotations

from ..quantization import QuantizerRole

__all__ = ["gemm_quantizer_roles"]

_FORWARD_TENSORS = ("input", "weight", None)
_BACKWARD_TENSORS = ("grad_output", None)


def gemm_quantizer_roles(
    module_type: str, gemm_names: list[str], *, fwd: bool, num_quantizers: int
) -> list[QuantizerRole | None]:
    """Roles of ``num_quantizers`` slots of one direction, GEMM ``i`` named ``gemm_names[i]``."""
    tensors = _FORWARD_TENSORS if fwd else _BACKWARD_TENSORS
    if num_quantizers != len(tensors) * len(gemm_names):
        raise ValueError(
            f"{module_type}: {num_quantizers} {'forward' if fwd else 'backward'} quantizer "
            f"slots for {len(gemm_names)} GEMMs; expected {len(tensors) * len(gemm_names)}"
        )
    return [
        None if tensor is None else QuantizerRole(module_type, tensor, name)
        for name in gemm_names
        for tensor in tensors
    ]
