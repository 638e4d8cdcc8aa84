"""``OperationContext``: what one basic operation carries from its forward to its backward.

Its own file so that the fuser (which makes one per basic operation) and the operation classes
(which run themselves through a fuser) need not import each other.
"""

from __future__ import annotations

__all__ = ["OperationContext"]


class OperationContext:
    """What one basic operation carries from its forward to its backward.

    Attributes
    ----------
    requires_grad : bool
        Whether the operation's backward runs at all (it is at or after the first operation
        that needs a gradient).
    input_requires_grad : bool
        Whether the gradient with respect to the operation's input is needed.
    to_save : tuple
        Tensors handed to :meth:`save_for_backward`; the fuser passes them through the autograd
        function's ``save_for_backward`` and restores them into ``saved_tensors``.
    saved_tensors : tuple
        Available in backward.
    """

    def __init__(self) -> None:
        self.requires_grad = False
        self.input_requires_grad = False
        self.to_save: tuple = ()
        self.saved_tensors: tuple = ()
        self._saved_tensors_range: tuple[int, int] | None = None
        self._saved_objects: list | None = None

    def save_for_backward(self, *tensors) -> None:
        """Keep ``tensors`` (tensors, quantized storages or ``None``) for the backward."""
        self.to_save = tensors
