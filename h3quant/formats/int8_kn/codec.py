"""``int8_tensorwise_kn``'s tensor work: int8_tensorwise's, with the weight stored [K, N].

The encoder returns canonical row chunks (``weight`` rows ``[n, K]``); the spec's
``transposed_outputs`` tells the writer to transpose them into the ``[K, N]`` tensor
(``h3quant.formats.int8_kn.tensors.RowTransposer``).
"""

from __future__ import annotations

from h3quant.formats.int8.codec import Int8Codec
from h3quant.formats.int8_kn.spec import NAME, SPEC  # noqa: F401  (re-exported)


class Int8KnCodec(Int8Codec):
    def source_tensors(self, fields, tensors):
        # the weight is read through column_sources: layer rows are columns of [K, N]
        return ["weight_scale"], []

    def encode(self, w, marker, method, pool=None, calibration=None):
        out = super().encode(w, marker, method, pool, calibration)
        out["weight_scale"] = out["weight_scale"].reshape(-1)
        return out

    def int8_grid(self, tensors, fields):
        import torch

        q = tensors["weight"].t()  # [N, K] view of the stored [K, N]: no copy
        return q, tensors["weight_scale"].to(torch.float32).reshape(-1)

    def nz_eligible(self, n, k):
        from h3quant.formats.int8_kn.tensors import nz_eligible

        return nz_eligible(n, k)


CODEC = Int8KnCodec(SPEC)
