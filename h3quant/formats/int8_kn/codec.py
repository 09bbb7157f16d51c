"""``int8_tensorwise_kn``'s tensor work: int8_tensorwise's, with the weight stored [K, N].

The encoder returns canonical row chunks (``weight`` rows ``[n, K]``); the spec's
``transposed_outputs`` tells the writer to transpose them into the ``[K, N]`` tensor
(``h3quant.formats.transpose.RowTransposer``).
"""

from __future__ import annotations

from h3quant.formats.codec import Checks, Codec
from h3quant.formats.int8.codec import Int8Decoder, Int8Encoder, Int8Grid
from h3quant.formats.int8_kn.spec import NAME, SPEC  # noqa: F401  (re-exported)


class Int8KnDecoder(Int8Decoder):
    def source_tensors(self, fields, tensors):
        # the weight is read through column_sources: layer rows are columns of [K, N]
        return ["weight_scale"], []


class Int8KnEncoder(Int8Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        out = super().encode(w, marker, method, pool, calibration)
        out["weight_scale"] = out["weight_scale"].reshape(-1)
        return out


class Int8KnGrid(Int8Grid):
    def int8_grid(self, tensors, fields):
        import torch

        q = tensors["weight"].t()  # [N, K] view of the stored [K, N]: no copy
        return q, tensors["weight_scale"].to(torch.float32).reshape(-1)

    def nz_eligible(self, n, k):
        from h3quant.formats.int8_kn.tensors import nz_eligible

        return nz_eligible(n, k)


class Int8KnChecks(Checks):
    def data_violation(self, suffix, values):
        """D107: the weight is stored untransposed. The encoder scales each output channel by
        its absmax / 127, so in canonical [N, K] codes every row peaks at |q| = 127. A kn weight
        whose every stored row peaks at 127 while some columns (its output channels) do not
        holds canonical codes under the kn name, which a square layer's shape cannot reveal:
        validate --deep, convert and verify refuse it alike, not only verify with a reference.
        (int8 taken from a W4A8 grid peaks in [96, 127] per channel and is not judged here.)"""
        if suffix != "weight" or values.dim() != 2 or values.numel() == 0:
            return None
        import torch

        from h3quant.formats.spec import Violation

        a = values.to(torch.int16).abs()
        rows, cols = a.amax(1), a.amax(0)
        if not bool((rows[rows > 0] == 127).all()) or not bool((rows > 0).any()):
            return None
        low = (cols > 0) & (cols < 127)
        n = int(low.sum())
        if not n:
            return None
        first = int(low.nonzero()[0, 0])
        return Violation("D107", f"every stored row peaks at |q| = 127 but {n} of "
                         f"{values.shape[1]} output channels (columns) do not (first: channel "
                         f"{first}, peak {int(cols[first])}): canonical [N, K] codes stored under "
                         "the int8_tensorwise_kn name (a square layer's shape cannot tell)",
                         "weight")


CODEC = Codec(SPEC, decoder=Int8KnDecoder(), encoder=Int8KnEncoder(), grid=Int8KnGrid(),
              checks=Int8KnChecks())
