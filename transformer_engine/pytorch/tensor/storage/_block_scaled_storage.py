"""What the block-scaled storages (``Float8BlockwiseQTensorStorage``, ``MXFP8TensorStorage``)
share: the four buffers (row-wise and column-wise data with their scale-inverses), handed out
and taken back in that order for autograd saving, and read back as data tensors."""

from __future__ import annotations

from ...quantized_tensor import QuantizedTensorStorage

__all__ = ["BUFFERS", "BlockScaledTensorStorage"]

# The buffers in saving order: row-wise data and scales, then column-wise data and scales.
BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")


class BlockScaledTensorStorage(QuantizedTensorStorage):
    """Base of the block-scaled storages: the buffer bookkeeping both keep identically."""

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """``(_rowwise_data, _columnwise_data)``, or one of them."""
        if rowwise_data and columnwise_data:
            return self._rowwise_data, self._columnwise_data
        if rowwise_data:
            return self._rowwise_data
        if columnwise_data:
            return self._columnwise_data
        raise ValueError("get_data_tensors: request rowwise_data and/or columnwise_data")

    def get_metadata(self) -> dict:
        """Keyword arguments that rebuild this object (shares the buffers)."""
        return {
            "rowwise_data": self._rowwise_data,
            "rowwise_scale_inv": self._rowwise_scale_inv,
            "columnwise_data": self._columnwise_data,
            "columnwise_scale_inv": self._columnwise_scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "quantizer": self._quantizer,
        }

    def prepare_for_saving(self):
        """Hand out the four buffers (``BUFFERS`` order) and drop them here."""
        tensors = [getattr(self, name) for name in BUFFERS]
        for name in BUFFERS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors):
        """Take the four buffers from the front of ``tensors``; return the rest."""
        if len(tensors) < 4:
            raise ValueError(
                f"{type(self).__name__}.restore_from_saved: expected at least 4 tensors, got "
                f"{len(tensors)}"
            )
        for name, t in zip(BUFFERS, tensors):
            setattr(self, name, t)
        return list(tensors[4:])
