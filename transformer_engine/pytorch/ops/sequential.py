"""``te.ops.Sequential``: a container that runs consecutive fusible operations through one
``OperationFuser`` each, and any other ``nn.Module`` as it is, in between."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

import torch

from .fuser import OperationFuser
from .op import BasicOperation, FusibleOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    """Sequential container of fusible operations and other modules.

    Parameters
    ----------
    *args : torch.nn.Module
        The modules in order, or a single ``dict`` (``OrderedDict``) of ``name -> module``.

    Consecutive ``FusibleOperation``s form one group run by an ``OperationFuser`` (one
    autograd function, with the registered fusions); other modules run on their own. Groups
    are rebuilt whenever the contents change. The fusers hold no parameters: they read the
    operations' current ones on every call, so deferred initialization (``device="meta"``,
    materialized by the first forward onto the input's device or by :meth:`reset_parameters`)
    never leaves a stale ``Parameter`` behind.
    """

    def __init__(self, *args: torch.nn.Module | dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self._module_groups: list | None = None
        self._grouped_modules: tuple = ()
        if len(args) == 1 and isinstance(args[0], dict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for module in args:
                self.append(module)

    # -- list-like interface ---------------------------------------------------------------------
    def _renumbered(self, modules: Iterable[torch.nn.Module]) -> None:
        modules = list(modules)
        self._modules = OrderedDict((str(i), m) for i, m in enumerate(modules))
        self._module_groups = None

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int | slice):
        modules = list(self._modules.values())
        if isinstance(index, slice):
            return Sequential(*modules[index])
        return modules[index]

    def __setitem__(self, index: int, module: torch.nn.Module) -> None:
        # As torch.nn.Sequential: the module is checked (a non-module failed only at the next
        # forward, as "'int' object is not callable") and takes the replaced one's name (a
        # Sequential built from a dict kept its names, and its state-dict keys, until then)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential holds torch.nn.Modules, got {type(module).__name__}")
        keys = list(self._modules.keys())
        self._modules[keys[index]] = module
        self._module_groups = None

    def __delitem__(self, index: int | slice) -> None:
        modules = list(self._modules.values())
        del modules[index]
        self._renumbered(modules)

    def append(self, module: torch.nn.Module) -> Sequential:
        """Add ``module`` at the end."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential holds torch.nn.Modules, got {type(module).__name__}")
        self.add_module(str(len(self)), module)
        self._module_groups = None
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> Sequential:
        """Add ``modules`` at the end, in order."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: torch.nn.Module) -> Sequential:
        """Insert ``module`` before position ``index``."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential holds torch.nn.Modules, got {type(module).__name__}")
        modules = list(self._modules.values())
        modules.insert(index, module)
        self._renumbered(modules)
        return self

    def pop(self, index: int = -1) -> torch.nn.Module:
        """Remove and return the module at ``index``."""
        modules = list(self._modules.values())
        module = modules.pop(index)
        self._renumbered(modules)
        return module

    def __add__(self, other: Sequential) -> Sequential:
        return Sequential(*self, *other)

    def __iadd__(self, other: Iterable[torch.nn.Module]) -> Sequential:
        return self.extend(other)

    # -- parameters ------------------------------------------------------------------------------
    def reset_parameters(self, device=None) -> None:
        """(Re)initialize every contained module's parameters.

        Fusible operations get ``device`` (where meta parameters go; default the current CUDA
        device, else the CPU); other modules, and their submodules, have their own
        ``reset_parameters()`` called when they define one.
        """
        for module in self:
            if isinstance(module, FusibleOperation):
                module.reset_parameters(device=device)
                continue
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()

    # -- forward ---------------------------------------------------------------------------------
    def _get_module_groups(self) -> list:
        modules = tuple(self._modules.values())
        if self._module_groups is not None and len(modules) == len(self._grouped_modules):
            if all(a is b for a, b in zip(modules, self._grouped_modules)):
                return self._module_groups
        groups: list = []
        run: list[FusibleOperation] = []
        for module in modules:
            if isinstance(module, FusibleOperation):
                run.append(module)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            groups.append(module)
        if run:
            groups.append(OperationFuser(run))
        self._module_groups, self._grouped_modules = groups, modules
        return groups

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor, op_kwargs=None):
        """Run the modules in order.

        Parameters
        ----------
        input : torch.Tensor
        *extra_inputs : torch.Tensor
            Consumed, in order, by the operations with extra inputs.
        op_kwargs : dict, optional
            Keyword arguments of individual basic operations, keyed by the operation or by its
            position in this container.

        Returns
        -------
        The output, or ``(output, *extra_outputs)`` when operations make extra outputs.
        """
        kwargs_by_op = {}
        for key, kwargs in (op_kwargs or {}).items():
            op = self[key] if isinstance(key, int) else key
            if not isinstance(op, BasicOperation):
                raise TypeError(
                    f"op_kwargs keys must be basic operations of this Sequential (or their "
                    f"positions), got {type(op).__name__}"
                )
            kwargs_by_op[id(op)] = kwargs
        x = input
        remaining = list(extra_inputs)
        extra_outputs: list[torch.Tensor] = []
        for group in self._get_module_groups():
            if not isinstance(group, OperationFuser):
                x = group(x)
                continue
            count = group.num_extra_inputs
            args, remaining = remaining[:count], remaining[count:]
            basic_op_kwargs = [kwargs_by_op.get(id(op), {}) for op in group.basic_ops]
            out = group(x, *args, basic_op_kwargs=basic_op_kwargs)
            if group.num_extra_outputs:
                x, *extras = out
                extra_outputs.extend(extras)
            else:
                x = out
        if remaining:
            raise ValueError(
                f"Sequential received {len(extra_inputs)} extra inputs but its operations take "
                f"{len(extra_inputs) - len(remaining)}"
            )
        return (x, *extra_outputs) if extra_outputs else x
