"""``awq_w4a16``: the codec. Reads, checks and decodes; writing needs calibration statistics."""

from __future__ import annotations

from h3quant.errors import UnsupportedError
from h3quant.formats.awq_w4a16.spec import REFUSAL, SPEC
from h3quant.formats.codec import Codec, DecodedGrid, Decoder, Emulator, Encoder


def _g(fields) -> int:
    return int((fields or {}).get("group_size", 64))


class AWQW4A16Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        return ["weight"], ["weight_scale", "weight_zeros"]

    def row_views(self, whole, fields):
        """The stored ``[K/G, N]`` scales and zeros as ``[N, K/G]`` views: row r is column r."""
        return {"scale_rows": whole["weight_scale"].t(), "zero_rows": whole["weight_zeros"].t()}

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.awq_w4a16.tensors import decode_awq

        q = rows["weight"].view(torch.int8)
        if "scale_rows" in rows:
            s, z = rows["scale_rows"], rows["zero_rows"]
        else:  # the whole layer
            s, z = whole["weight_scale"].t(), whole["weight_zeros"].t()
        return decode_awq(q, s, z, _g(fields))

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize in ``dtype``: (q - 8) * scale + zero."""
        import torch

        from h3quant.formats.awq_w4a16.tensors import decode_awq

        return decode_awq(tensors["weight"].view(torch.int8), tensors["weight_scale"].t(),
                          tensors["weight_zeros"].t(), _g(fields), dtype=dtype)


class AWQW4A16Emulator(Emulator):
    def emulated_linear(self, x, tensors, fields, bias=None):
        """``x W^T + b`` as comfy-kitchen's eager ``gemv_awq_w4a16`` computes it (in the
        scales' dtype), returned in ``x.dtype``."""
        import torch

        from h3quant.formats.awq_w4a16.tensors import awq_linear

        return awq_linear(x, tensors["weight"].view(torch.int8), tensors["weight_scale"],
                          tensors["weight_zeros"], _g(fields), bias)


class AWQW4A16Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is None:
            raise UnsupportedError(REFUSAL, code="Q105")
        from h3quant.formats.awq_w4a16.encoder import encode_awq_w4a16

        t = encode_awq_w4a16(w, calibration, group_size=_g(marker))
        return {"weight": t["qweight"], "weight_scale": t["wscales"], "weight_zeros": t["wzeros"]}

    def channel_scale(self, w, marker, calibration):
        """(``s`` [K] or None, the statistics of ``x / s`` or None, the search's figures): see
        ``scaling.search_channel_scale``."""
        from h3quant.formats.awq_w4a16.scaling import search_channel_scale

        return search_channel_scale(w, calibration, group_size=_g(marker))

    def report_grid(self, out, marker):
        from h3quant.formats.awq_w4a16.encoder import decode_awq_w4a16

        t = {"qweight": out["weight"], "wscales": out["weight_scale"].t(),  # sampled as rows
             "wzeros": out["weight_zeros"].t()}
        return decode_awq_w4a16(t, _g(marker)), None


CODEC = Codec(SPEC, decoder=AWQW4A16Decoder(), encoder=AWQW4A16Encoder(), grid=DecodedGrid(),
              emulator=AWQW4A16Emulator())
