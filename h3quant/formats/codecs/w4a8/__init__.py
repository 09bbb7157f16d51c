"""``asym_w4a8_int8`` (W4A8): the codec object (``codec``), its tensor functions (``tensors``), the
chunk encoder (``encoder``) and the level tables (``codebook``)."""
