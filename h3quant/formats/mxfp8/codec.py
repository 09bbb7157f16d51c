"""The ``mxfp8`` codec: e4m3 codes, e8m0 block scales per 32 values in cuBLAS's blocked layout."""

from __future__ import annotations

from dataclasses import replace

from h3quant.formats.codec import Checks, Codec, Decoder, Encoder
from h3quant.formats.fp8 import rules
from h3quant.formats.mxfp8.spec import BLOCK, SPEC


class MxFp8Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        return ["weight"], ["weight_scale"]

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.mxfp8.tensors import decode_mxfp8

        return decode_mxfp8(rows["weight"], whole["weight_scale"], torch.float32,
                            row0=rows.get("_row0", 0))

    def decode_weight(self, tensors: dict, fields: dict | None, dtype):
        from h3quant.formats.mxfp8.tensors import decode_mxfp8

        return decode_mxfp8(tensors["weight"], tensors["weight_scale"], dtype)


class MxFp8Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        from h3quant.formats.mxfp8.tensors import encode_mxfp8

        q, s = encode_mxfp8(w, pool=pool)
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        import torch

        from h3quant.formats.mxfp8.tensors import decode_mxfp8

        from h3quant.formats.mxfp8.tensors import block_scales, e8m0_to_f32

        q, scales = out["weight"], out["weight_scale"]
        rows = out.get("_rows")
        if rows is None:
            return decode_mxfp8(q, scales, torch.float32), None
        # sampled rows (convert's report): their scales from the unswizzled table
        n = int(scales.shape[0])
        k = q.shape[1]
        s = e8m0_to_f32(block_scales(scales, n, k)[rows.long()])
        w = q.to(torch.float32).reshape(q.shape[0], k // BLOCK, BLOCK) * s.unsqueeze(-1)
        return w.reshape(q.shape[0], k), None


class MxFp8Checks(Checks):
    def value_violations(self, tensors: dict) -> list:
        """Data rules over loaded tensors (verify): e8m0 scales not NaN, codes finite."""
        out = [replace(v, suffix="input_scale") for v in rules.scale_violations(
            tensors["input_scale"])] if "input_scale" in tensors else []
        for v in (rules.e8m0_violation(tensors["weight_scale"]),
                  rules.nonfinite_codes(tensors["weight"])):
            if v is not None:
                out.append(v)
        return out

    def deep_findings(self, read, tensors: dict) -> list:
        import torch

        out = []
        s = tensors.get("weight_scale")
        if s is not None and s.dtype in ("F8_E8M0", "U8"):
            for chunk in read(s, torch.uint8):
                v = rules.e8m0_violation(chunk)
                if v is not None:
                    out.append(v)
                    break
        w = tensors.get("weight")
        if w is not None and w.dtype == "F8_E4M3":
            for chunk in read(w, torch.float8_e4m3fn):
                v = rules.nonfinite_codes(chunk)
                if v is not None:
                    out.append(v)
                    break
        return out


CODEC = Codec(SPEC, decoder=MxFp8Decoder(), encoder=MxFp8Encoder(), checks=MxFp8Checks())
