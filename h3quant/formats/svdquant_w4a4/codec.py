"""``svdquant_w4a4``: the codec. Reads, checks and decodes (kitchen's dequantize); never writes."""

from __future__ import annotations

from h3quant.errors import UnsupportedError
from h3quant.formats.codec import Codec, DecodedGrid, Decoder, Encoder
from h3quant.formats.svdquant_w4a4.spec import READ_ONLY, SPEC, SPELLINGS, spelling


def _names(tensors) -> tuple[str, str, str]:
    names = spelling(tensors)
    if names is None:  # the header rules refuse such a layer before any data is read
        raise UnsupportedError("svdquant_w4a4 layer lacks its low-rank or smoothing tensors",
                               code="Q101")
    return names


class SVDQuantW4A4Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        down, up, smooth = spelling(tensors) or SPELLINGS[0]  # missing ones: the rules say so
        return ["weight"], ["weight_scale", down, up, smooth]

    def row_views(self, whole, fields):
        """The stored ``[K/64, N]`` scales as ``[N, K/64]`` rows, and the low-rank branch of
        every row (computed once for the layer, as kitchen does)."""
        from h3quant.formats.svdquant_w4a4.tensors import lowrank

        down, up, _ = _names(whole)
        s = whole["weight_scale"]
        return {"scale_rows": s.t(), "lowrank_rows": lowrank(whole[down], whole[up], s.dtype)}

    def decode_rows(self, rows, whole, fields):
        from h3quant.formats.svdquant_w4a4.tensors import decode_svdquant, lowrank

        _, up, smooth = names = _names(whole)
        s = whole["weight_scale"]
        if "scale_rows" in rows:
            sr, lr = rows["scale_rows"], rows["lowrank_rows"]
        else:  # the whole layer
            sr, lr = s.t(), lowrank(whole[names[0]], whole[up], s.dtype)
        import torch

        return decode_svdquant(rows["weight"].view(torch.int8), sr, lr, whole[smooth]).float()

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize (in the scales' dtype), then ``dtype``."""
        import torch

        from h3quant.formats.svdquant_w4a4.tensors import decode_layer

        down, up, smooth = _names(tensors)
        w = decode_layer(tensors["weight"].view(torch.int8), tensors["weight_scale"],
                         tensors[down], tensors[up], tensors[smooth])
        return w.to(dtype)


class SVDQuantW4A4Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        raise UnsupportedError(READ_ONLY, code="Q105")


CODEC = Codec(SPEC, decoder=SVDQuantW4A4Decoder(), encoder=SVDQuantW4A4Encoder(),
              grid=DecodedGrid())
