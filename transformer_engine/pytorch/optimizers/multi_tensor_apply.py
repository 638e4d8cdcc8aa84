"""``multi_tensor_applier``: upstream's calling convention for the ``multi_tensor_*`` operations.

A multi-tensor operation takes ``(chunk_size, noop_flag, tensor_lists, *args)``: ``tensor_lists``
is a list of equally long lists whose i-th entries belong together (a gradient, its parameter,
its moments). Upstream's CUDA kernels cut the tensors into chunks of ``chunk_size`` elements and
launch over all of them at once; here the operations are built on PyTorch's ``torch._foreach_*``
kernels, which batch the launches the same way, so ``chunk_size`` is accepted and carries no
meaning. The applier is where callers' lists are tidied first, as upstream's is: DTensors give
their local shards, and a slot whose first tensor is empty is dropped from every list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


def _local(t):
    """A DTensor's local shard; any other value as it is."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()
    return t


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)`` on tidied lists.

    Parameters
    ----------
    chunk_size : int
        Passed to ``op`` (upstream's kernels' chunk length; PyTorch's foreach kernels here).
    """

    def __init__(self, chunk_size: int):
        self.chunk_size = int(chunk_size)

    def __call__(
        self,
        op: Callable,
        noop_flag_buffer: torch.Tensor,
        tensor_lists: Sequence[Sequence[torch.Tensor]],
        *args,
    ):
        """Run ``op`` over ``tensor_lists``; ``None`` when no slot holds any element.

        Raises ``ValueError`` when the lists differ in length (their slots would pair the
        wrong tensors).
        """
        lists = [[_local(t) for t in tensors] for tensors in tensor_lists]
        if not lists:
            return None
        lengths = {len(tensors) for tensors in lists}
        if len(lengths) != 1:
            raise ValueError(
                f"multi_tensor_applier: the tensor lists have different lengths "
                f"{[len(t) for t in lists]}; each list must hold one tensor per slot"
            )
        keep = [i for i, t in enumerate(lists[0]) if t.numel() > 0]
        if len(keep) != len(lists[0]):
            lists = [[tensors[i] for i in keep] for tensors in lists]
        if not keep:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


# Upstream's default chunk length, 2048 * 32 elements.
multi_tensor_applier = MultiTensorApply(2048 * 32)
