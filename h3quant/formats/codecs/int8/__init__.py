"""``int8_tensorwise``: the codec object (``codec``) and its tensor functions (``tensors``)."""
