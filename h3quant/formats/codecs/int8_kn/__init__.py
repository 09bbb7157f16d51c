"""``int8_tensorwise_kn``, the NPU pre-transposed int8 layout: codec object and tensor functions."""
