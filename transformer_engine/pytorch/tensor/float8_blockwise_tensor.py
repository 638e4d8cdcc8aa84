"""Block-scaled FP8 tensors (the ``Float8BlockScaling`` recipe): upstream's import path.

* :class:`Float8BlockQuantizer` (in :mod:`._float8_block_quantizer`) casts a high-precision
  tensor with one float32 scale per 1x128 tile or 128x128 block;
* :class:`Float8BlockwiseQTensor` (in :mod:`._float8_blockwise_tensor_class`) is the result,
  presented as a high-precision tensor;
* its buffers and their layout are described in
  :mod:`transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage`.
"""

from ._float8_block_quantizer import Float8BlockQuantizer
from ._float8_blockwise_tensor_class import Float8BlockwiseQTensor

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensor"]
