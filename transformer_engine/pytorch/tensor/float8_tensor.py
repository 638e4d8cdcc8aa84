"""``Float8Tensor``: a per-tensor-scaled FP8 tensor that behaves like a high-precision tensor,
and the quantizers that produce it.

* :class:`Float8Tensor` presents its nominal dtype (float32, float16 or bfloat16), shape and
  device; its values are FP8 bytes times ``_scale_inv``. The class is defined in
  :mod:`transformer_engine.pytorch.tensor._float8_tensor_class`, the aten operations it performs
  on its bytes in :mod:`transformer_engine.pytorch.tensor._float8_dispatch`, and its buffers in
  :mod:`transformer_engine.pytorch.tensor.storage.float8_tensor_storage`.
* :class:`Float8Quantizer` (delayed scaling) and :class:`Float8CurrentScalingQuantizer` are
  defined in :mod:`transformer_engine.pytorch.tensor._float8_quantizers`, above the tensor
  class, which they construct.

This module is where all three are imported from (the upstream path), and the name
checkpoints use for the pickled reconstructor ``_make_float8_tensor_in_reduce_ex``.
"""

from ._float8_quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from ._float8_tensor_class import Float8Tensor, _make_float8_tensor_in_reduce_ex  # noqa: F401

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor"]

# _make_float8_tensor_in_reduce_ex is imported for pickles: they name it by this module (see
# _float8_tensor_class), not in __all__ because it is no API.
