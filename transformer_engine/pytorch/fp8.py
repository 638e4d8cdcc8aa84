"""Deprecated module name: use ``transformer_engine.pytorch.quantization``."""

import warnings

from .quantization import *  # noqa: F401,F403
from .quantization import (  # noqa: F401
    _amax_and_scale_update,
    _compute_amax_and_update_history,
    _compute_scaling_factor,
    _default_get_amax_and_update_history,
    _default_sf_compute,
    _update_amax_history,
    split_and_copy,
)

warnings.warn(
    "transformer_engine.pytorch.fp8 is deprecated; import from "
    "transformer_engine.pytorch.quantization",
    DeprecationWarning,
    stacklevel=2,
)
