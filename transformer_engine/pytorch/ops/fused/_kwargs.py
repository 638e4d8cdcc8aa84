"""The refusal every fused forward without per-operation keyword arguments shares."""

from __future__ import annotations

__all__ = ["refuse_kwargs"]


def refuse_kwargs(name: str, basic_op_kwargs) -> None:
    """Raise ``ValueError`` when any of ``basic_op_kwargs`` (one dict per covered operation)
    is non-empty: the fused operation ``name`` runs its operations with none."""
    if any(basic_op_kwargs):
        raise ValueError(f"{name} takes no per-operation kwargs, got {basic_op_kwargs}")
