"""``OperationContext``: what one basic operation carries from its forward to its backward.

Its own file so that the fuser (which makes one per basic operation) and the operation classes
(which run themselves through a fuser) need not import each other.
"""

from __future__ import annotations

import dataclasses

__all__ = ["OperationContext"]


@dataclasses.dataclass(eq=False)
class OperationContext:
    """What one basic operation carries from its forward to its backward (a dataclass, as
    upstream's; the fuser sets the two flags for each operation it runs).

    Attributes
    ----------
    requires_grad : bool, default True
        Whether the operation's backward runs at all (it is at or after the first operation
        that needs a gradient). ``True`` for a context made by hand, so an operation's
        ``op_forward`` run outside a fuser saves what its ``op_backward`` needs.
    input_requires_grad : bool, default True
        Whether the gradient with respect to the operation's input is needed.
    to_save : tuple
        Tensors handed to :meth:`save_for_backward`; the fuser passes them through the autograd
        function's ``save_for_backward`` and restores them into ``saved_tensors``.
    saved_tensors : tuple
        Available in backward.
    """

    saved_tensors: tuple = ()
    to_save: tuple = ()
    _saved_tensors_range: tuple[int, int] | None = None
    requires_grad: bool = True
    input_requires_grad: bool = True
    _saved_objects: list | None = None

    def save_for_backward(self, *tensors) -> None:
        """Keep ``tensors`` (tensors, quantized storages or ``None``) for the backward."""
        self.to_save = tensors
