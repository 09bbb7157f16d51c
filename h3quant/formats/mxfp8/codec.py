"""The ``mxfp8`` codec: e4m3 codes, e8m0 block scales per 32 values in cuBLAS's blocked layout."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, Target, VerifyLimits
from h3quant.formats.fp8 import rules
from h3quant.formats.mxfp8.spec import BLOCK, SPEC, scale_shape


class MxFp8Codec(Codec):
    name = SPEC.name
    quantized = True
    description = SPEC.help
    targets = (Target(SPEC.target, SPEC.name, False, SPEC.help),)
    verify = VerifyLimits(rel_err=SPEC.verify_rel_err, block_sqnr_db=SPEC.verify_block_sqnr_db)
    marker_defaults = {"full_precision_matrix_mult": False}
    runtime_tensors = ("weight", "weight_scale")
    runtime_required = ("weight", "weight_scale")
    deep_scales = ("input_scale",)  # the e8m0 block scales have their own rule (D131)
    chunked = False  # the blocked scales hold 128 rows per tile: whole layer, 128-row chunks
    unrowed_outputs = ("weight_scale",)
    weight_bits = 8
    decodes = True
    kernel = ("mxfp8 block-scaled mm (comfy-kitchen TensorCoreMXFP8Layout)", (10, 0))
    needs_row0 = True  # decode_rows gets the chunk's first row as rows["_row0"]
    spec = SPEC

    def marker(self, target, group_size):
        return {"format": self.name}

    def violations(self, tensors: dict, fields: dict | None = None):
        return rules.mxfp8_violations(tensors)

    def fit_error(self, layer, fields):
        return rules.first(self.violations(layer.tensors, fields))

    def same_target(self, layer, fields, marker):
        return fields["format"] == self.name

    def skip_reason(self, k, marker):
        if k % BLOCK:
            return f"K={k} is not a multiple of {BLOCK} (mxfp8 blocks)"
        return None

    def planned(self, n, k, marker):
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F8_E8M0", scale_shape(n, k))}

    def keep_declared(self, suffix, dtype, shape, n):
        return ("F8_E8M0" if suffix == "weight_scale" and dtype == "U8" else dtype), shape

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

    def encode(self, w, marker, method, pool=None):
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

    def value_violations(self, tensors: dict) -> list:
        """Data rules over loaded tensors (verify): e8m0 scales not NaN, codes finite."""
        from h3quant.formats.rules.checks import scale_violations

        out = [v for v in scale_violations(tensors["input_scale"])] \
            if "input_scale" in tensors else []
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


CODEC = MxFp8Codec()
CODECS = (CODEC,)
