"""``convrot_w4a4`` (INT4 ConvRot): the codec (torch is imported by the tensor methods only)."""

from __future__ import annotations

from h3quant.formats.codec import Codec
from h3quant.formats.int4_convrot.spec import ALIAS_SPEC, SPEC
from h3quant.formats.spec import Violation


def _g(fields) -> int:
    return int((fields or {}).get("convrot_groupsize", 256))


class ConvRotW4A4Codec(Codec):
    def source_tensors(self, fields, tensors):
        return ["weight", "weight_scale"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(rows["weight"].view(torch.int8), rows["weight_scale"].reshape(-1),
                                   _g(fields))

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize: fp32 codes x scales rotated back, then ``dtype``."""
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(tensors["weight"].view(torch.int8),
                                   tensors["weight_scale"].reshape(-1), _g(fields), dtype=dtype)

    def emulated_linear(self, x, tensors, fields, bias=None):
        """``x W^T + b`` as ComfyUI computes it without the int4 kernel (comfy-kitchen's eager
        W4A4 path): x rotated and quantized per token to int4, a matmul of the codes in
        ``x.dtype``, both scales."""
        import torch

        from h3quant.formats.int4_convrot.tensors import w4a4_linear

        return w4a4_linear(x, tensors["weight"].view(torch.int8), tensors["weight_scale"],
                           _g(fields), bias)

    def rounded_inputs(self, x, fields):
        """(``x`` in the ConvRot basis, the same rounded to int4 per token), fp32: what
        ``emulated_linear`` multiplies the codes with."""
        from h3quant.formats.int4_convrot.tensors import rounded_activations

        return rounded_activations(x, _g(fields))

    def int8_grid(self, tensors, fields):
        """No int8 grid: the runtime runs these layers through ``decode_weight`` (dequant)."""
        from h3quant.errors import UnsupportedError

        raise UnsupportedError(f"{self.spec.name} layers have no int8 grid; the runtime runs "
                               "them through their float decode (dequant)", code="Q105")

    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:  # the same rotation and scales, codes by error feedback
            from h3quant.formats.int4_convrot.calibrated import encode_int4_convrot_calibrated

            q, s = encode_int4_convrot_calibrated(w, calibration, _g(marker))
            return {"weight": q, "weight_scale": s}
        from h3quant.formats.int4_convrot.tensors import encode_int4_convrot

        q, s = encode_int4_convrot(w, _g(marker))
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(out["weight"], out["weight_scale"].reshape(-1), _g(marker)), None

    def layer_data_violations(self, tensors, read, fields):
        import torch

        from h3quant.formats.int4_convrot.tensors import count_minus8

        w = tensors.get("weight")
        if w is None or w.dtype not in ("I8", "U8"):
            return []
        n = count_minus8(read(w, torch.int8))
        if not n:
            return []
        return [Violation("D122", f"{n} of {2 * w.numel} int4 codes are -8; the quantizer writes "
                          "codes in [-7, 7] (legal storage, but not the reference encoder's)")]


CODEC = ConvRotW4A4Codec(SPEC)
ALIAS_CODEC = ConvRotW4A4Codec(ALIAS_SPEC)  # int4_tensorwise: the same tensor work
