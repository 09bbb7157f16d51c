"""The fp8 codecs' tensor work: ``float8_e4m3fn`` and ``float8_e5m2`` (one fp32 scale per tensor)."""

from __future__ import annotations

from dataclasses import replace

from h3quant.formats.codec import Checks, Codec, Decoder, Encoder
from h3quant.formats.fp8 import rules
from h3quant.formats.fp8.spec import E4M3, E5M2, codes_of


def _dtype(spec):
    import torch

    return getattr(torch, codes_of(spec).torch_dtype)


class Fp8Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        s = tensors["weight_scale"]
        return (["weight"], ["weight_scale"]) if s.numel == 1 else (["weight", "weight_scale"], [])

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.fp8.tensors import decode_fp8

        s = whole["weight_scale"] if "weight_scale" in whole else rows["weight_scale"]
        s = s.float().reshape(()) if s.numel() == 1 else s.float().reshape(-1, 1)
        return decode_fp8(rows["weight"], s, torch.float32)

    def decode_weight(self, tensors: dict, fields: dict | None, dtype):
        """The weight as ComfyUI's path without a kernel computes with it: kitchen's
        ``dequantize_per_tensor_fp8`` into ``dtype``."""
        from h3quant.formats.fp8.tensors import decode_fp8

        s = tensors["weight_scale"].float()
        s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
        return decode_fp8(tensors["weight"], s, dtype)


class Fp8Encoder(Encoder):
    """A per-tensor-scaled fp8 layer: one amax over the whole layer (a first pass over its
    rows), then row chunks."""

    def encode(self, w, marker, method, pool=None, calibration=None):
        from h3quant.formats.fp8.tensors import encode_fp8

        q, s = encode_fp8(w, _dtype(self.spec), pool=pool)
        return {"weight": q, "weight_scale": s}

    def encode_in_dtype(self, w, marker):
        """The encode comfy-kitchen makes from ``w`` in its own dtype (bf16 / f16): the same
        steps as ``encode``, in that dtype (the scale's amax and the reciprocal's product)."""
        return self.encode(w, marker, "exact")

    def scan_rows(self, w):
        from h3quant.formats.fp8.tensors import amax_of

        return amax_of(w)

    def layer_value(self, parts):
        import torch

        from h3quant.formats.fp8.tensors import scale_from_amax

        return scale_from_amax(torch.stack(parts).amax(), _dtype(self.spec))

    def encode_rows(self, w, marker, method, value):
        from h3quant.formats.fp8.tensors import encode_fp8

        q, s = encode_fp8(w, _dtype(self.spec), scale=value)
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        import torch

        from h3quant.formats.fp8.tensors import decode_fp8

        return decode_fp8(out["weight"], out["weight_scale"], torch.float32), None


class Fp8Checks(Checks):
    def value_violations(self, tensors: dict) -> list:
        """Data rules over loaded tensors (verify): scales finite and > 0, codes finite."""
        out = [replace(v, suffix=s) for s in ("weight_scale", "input_scale") if s in tensors
               for v in rules.scale_violations(tensors[s])]
        v = rules.nonfinite_codes(tensors["weight"])
        return out + ([v] if v is not None else [])

    def deep_findings(self, read, tensors: dict) -> list:
        """``validate --deep`` beyond the scales: D130 for codes that decode to NaN or inf."""
        w = tensors.get("weight")
        if w is None or w.dtype != codes_of(self.spec).code_dtype:
            return []
        for chunk in read(w, _dtype(self.spec)):
            v = rules.nonfinite_codes(chunk)
            if v is not None:
                return [v]
        return []


def _codec(spec):
    return Codec(spec, decoder=Fp8Decoder(), encoder=Fp8Encoder(), checks=Fp8Checks())


E4M3_CODEC = _codec(E4M3)
E5M2_CODEC = _codec(E5M2)
CODEC = E4M3_CODEC
