"""The checkpoint extra-state format of modules and fusible operations, and the reader of
upstream Transformer Engine's pickle-based checkpoints.

* :mod:`.contents`: what an extra state holds (tensor names, recipe classes, the
  :class:`UnpackedExtraState` result) and the checks and copies both readers share;
* :mod:`.recipe_dict`: a recipe as plain data;
* :mod:`.format`: our format, :func:`pack_extra_state` / :func:`unpack_extra_state` /
  :func:`empty_extra_state`; version 2 bytes laid out in :mod:`.bytes_format`, version 1 dicts
  (still read) in :mod:`.dict_format`;
* :mod:`.upstream_pickle`: upstream's pickles, refused unless
  ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``.

This package needs only torch and ``transformer_engine.common.recipe``; ``module/`` and
``ops/`` build their ``get_extra_state`` / ``set_extra_state`` on it.
"""

from .bytes_format import MAGIC as EXTRA_STATE_MAGIC
from .contents import TENSOR_NAMES, UnpackedExtraState
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    READABLE_VERSIONS,
    empty_extra_state,
    pack_extra_state,
    unpack_extra_state,
)
from .recipe_dict import CALLABLE_PLACEHOLDER, recipe_from_dict, recipe_to_dict

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "EXTRA_STATE_MAGIC",
    "TENSOR_NAMES",
    "CALLABLE_PLACEHOLDER",
    "UnpackedExtraState",
    "empty_extra_state",
    "pack_extra_state",
    "unpack_extra_state",
    "recipe_to_dict",
    "recipe_from_dict",
]
