"""The functional core: linear, normalization and activations as plain functions of tensors
and a small config, shared by te modules and te.ops; it reads and writes no global state."""
