"""``te.LayerNorm``: layer normalization over the trailing ``normalized_shape`` dimensions."""

from __future__ import annotations

from ..functional.normalization import layernorm
from ._norm_module_base import _NormModule, gamma_initial_value, zero_initial_value

__all__ = ["LayerNorm"]


class LayerNorm(_NormModule):
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions of the input.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \varepsilon}} \cdot \gamma + \beta

    Upstream Transformer Engine builds this module on the fusible-ops API (it subclasses
    ``te.ops.LayerNorm``); this project adds that API later, so for now it is a plain
    ``torch.nn.Module`` with the same constructor, parameters and forward.

    Parameters
    ----------
    normalized_shape : int or iterable of int
        Shape of the trailing dimensions normalized together: an int for the last dimension,
        or a tuple, list or ``torch.Size`` for several (as ``torch.nn.LayerNorm``).
    eps : float, default = 1e-5
        Added to the variance for numerical stability.
    sequence_parallel : bool, optional
        Sets the attribute ``sequence_parallel`` on the parameters (used by Megatron-style
        gradient reductions). ``None`` sets nothing.
    params_dtype : torch.dtype, optional
        Deprecated alias of ``dtype``.
    zero_centered_gamma : bool, default = `False`
        Store :math:`\gamma - 1` in ``weight`` (initialized to 0) and scale by
        ``1 + weight``, so that weight decay pulls the scale towards 1.
    hidden_size : int, optional
        Deprecated alias of ``normalized_shape``.
    device : torch.device or str, optional
        Device of the parameters. ``None`` means the current CUDA device when CUDA is
        available, else the CPU; ``"cuda"`` without an index means the current CUDA device at
        construction. ``"meta"`` defers initialization: no storage is allocated until
        ``reset_parameters()`` (optionally after ``module.to_empty(device=...)``).
    dtype : torch.dtype, optional
        Parameter dtype; default ``torch.get_default_dtype()``.
    sm_margin : int, default = 0
        Number of SMs to leave free for concurrent communication kernels. Kept for
        compatibility: the PyTorch implementation launches no kernels of its own.

    Attributes
    ----------
    weight : torch.nn.Parameter
        :math:`\gamma` of shape ``normalized_shape``, initialized to 1 (0 with
        ``zero_centered_gamma``).
    bias : torch.nn.Parameter
        :math:`\beta` of shape ``normalized_shape``, initialized to 0.

    Notes
    -----
    The statistics and the affine transform are computed in float32 whatever the dtype of the
    input or the parameters; the output has the input's dtype. The forward runs on the input's
    device, which must be the parameters' device.
    """

    _norm_params = (("weight", gamma_initial_value), ("bias", zero_initial_value))
    _norm_fn = staticmethod(layernorm)

    def reset_layer_norm_parameters(self) -> None:
        """Deprecated alias of :meth:`reset_parameters`."""
        self._warn_deprecated("reset_layer_norm_parameters", "reset_parameters")
        self.reset_parameters()
