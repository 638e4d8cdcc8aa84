"""Delayed weight gradients (``delay_wgrad_compute=True``) on the modules: backward queues the
weight-gradient GEMMs and :meth:`~DelayedWgrad.backward_dw` runs them later (a pipeline
schedule overlaps them with other work), then the hooks a framework registered to accumulate
and reduce those gradients (Megatron-LM's data-parallel reduction)."""

from __future__ import annotations

from collections.abc import Callable

from ..functional.linear import run_deferred_wgrads

__all__ = ["DelayedWgrad"]


class DelayedWgrad:
    """Mixin of ``TransformerEngineBaseModule``: the deferred weight-gradient queue."""

    def _init_wgrad_store(self, delay_wgrad_compute: bool, parameters_split=None) -> None:
        """``delay_wgrad_compute=True``: backward queues its weight-gradient GEMMs here and
        :meth:`backward_dw` runs them (bias and input gradients are not delayed)."""
        if delay_wgrad_compute and parameters_split is not None:
            raise ValueError(
                f"{type(self).__name__}: delay_wgrad_compute=True cannot be combined with "
                "parameters_split: the deferred gradient goes to one weight parameter"
            )
        self.wgrad_store = [] if delay_wgrad_compute else None

    def need_backward_dw(self) -> bool:
        """Whether weight gradients wait for :meth:`backward_dw` (``delay_wgrad_compute``)."""
        return getattr(self, "wgrad_store", None) is not None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at the end of each :meth:`backward_dw`, once the delayed weight
        gradients are in ``.grad`` / ``main_grad``: where a framework accumulates and reduces
        them (their autograd hooks cannot: the gradients did not exist when backward ran)."""
        if not callable(hook):
            raise TypeError(
                f"{type(self).__name__}: the wgrad accumulation and reduce hook must be callable, "
                f"got {type(hook).__name__}"
            )
        self.__dict__.setdefault("wgrad_accumulation_and_reduce_hooks", []).append(hook)

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs that backward deferred, in order, into ``.grad`` (or
        ``main_grad`` with ``fuse_wgrad_accumulation``), then the registered hooks. Without
        ``delay_wgrad_compute`` there is nothing deferred and nothing runs."""
        if not self.need_backward_dw():
            return
        run_deferred_wgrads(self.wgrad_store)
        for hook in self.__dict__.get("wgrad_accumulation_and_reduce_hooks", ()):
            hook()
