"""Deprecated module name: use ``transformer_engine.pytorch.quantization``.

Kept because code written for upstream imports from it, e.g. Hugging Face accelerate's
``from transformer_engine.pytorch.fp8 import check_mxfp8_support``.
"""

import warnings

from .quantization import *  # noqa: F401,F403
from .quantization import (  # noqa: F401
    _amax_and_scale_update,
    _compute_amax_and_update_history,
    _compute_scaling_factor,
    _default_get_amax_and_update_history,
    _default_sf_compute,
    _update_amax_history,
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    split_and_copy,
)

warnings.warn(
    "transformer_engine.pytorch.fp8 is deprecated; import from "
    "transformer_engine.pytorch.quantization",
    DeprecationWarning,
    stacklevel=2,
)
