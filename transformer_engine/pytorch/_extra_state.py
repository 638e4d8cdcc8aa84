"""Upstream's import path for the checkpoint extra-state pickle policy.

Code written for NVIDIA Transformer Engine imports these names from
``transformer_engine.pytorch._extra_state``. The implementation is
:mod:`transformer_engine.pytorch.extra_state.pickle_policy`, the same classification this
package's modules apply when they load an upstream checkpoint. Upstream has no
pack/unpack functions here; this package's format is
:func:`transformer_engine.pytorch.extra_state.pack_extra_state` /
:func:`~transformer_engine.pytorch.extra_state.unpack_extra_state`.
"""

from .extra_state.pickle_policy import RECIPE_POLICIES as _RECIPE_POLICIES
from .extra_state.pickle_policy import (
    UNSAFE_PICKLE_EXTRA_STATE_ENV,
    CheckpointExtraStatePolicy,
    is_stateless_recipe,
    recipe_extra_state_policy,
    should_load_extra_state_pickle,
)

__all__ = [
    "UNSAFE_PICKLE_EXTRA_STATE_ENV",
    "CheckpointExtraStatePolicy",
    "recipe_extra_state_policy",
    "is_stateless_recipe",
    "should_load_extra_state_pickle",
    "_RECIPE_POLICIES",
]
