"""``convrot_w4a4`` (INT4 ConvRot): the codec (torch is imported by the tensor methods only)."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, Target, VerifyLimits
from h3quant.formats.int4_convrot import spec
from h3quant.formats.rules.checks import Violation

NAME = spec.NAME


def _first(found: list[Violation]) -> str | None:
    if not found:
        return None
    v = found[0]
    return f"[{v.code}] {v.message}" if v.suffix == "weight" else f"[{v.code}] {v.suffix}: {v.message}"


class ConvRotW4A4(Codec):
    name = NAME
    description = spec.DESCRIPTION
    targets = (Target("int4-convrot", NAME, True,
                      "INT4 ConvRot (convrot_w4a4): signed int4, fp32 row scales, ConvRot"),)
    verify = VerifyLimits(rel_err=0.3, block_sqnr_db=6.0)
    marker_defaults = spec.MARKER_DEFAULTS
    runtime_tensors = ("weight", "weight_scale")
    runtime_required = runtime_tensors
    deep_scales = ("weight_scale",)
    always_convrot = True
    weight_bits = 4
    decodes = True  # the runtime may run it through decode_weight (dequantizing)
    kernel = ("int4 MMA (comfy-kitchen TensorCoreConvRotW4A4Layout)", (7, 5))

    def logical_k(self, cols, fields):
        return 2 * cols

    def logical_shape(self, shape, fields):
        return spec.logical_shape(shape, fields)

    def describe(self, fields):
        f = fields or {}
        text = f"{NAME} g={f.get('convrot_groupsize', 256)}"
        return text + (" linear=int8" if f.get("linear_dtype") == "int8" else "")

    def marker(self, target, group_size):
        return spec.marker(group_size)

    def fit_error(self, layer, fields):
        return _first(spec.rules(fields, layer.tensors))

    def same_target(self, layer, fields, marker):
        return (fields["format"] == NAME
                and fields.get("convrot_groupsize") == marker["convrot_groupsize"]
                and fields.get("linear_dtype", "int4") == marker.get("linear_dtype", "int4"))

    def skip_reason(self, k, marker):
        why = spec.k_error(k, marker["convrot_groupsize"])
        if why is None and k % spec.QUANT_GROUP:
            why = f"K={k} is not divisible by the int4 kernel's group size {spec.QUANT_GROUP}"
        return why

    def planned(self, n, k, marker):
        return {"weight": ("I8", (n, k // 2)), "weight_scale": ("F32", (n,))}

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix == "weight" and dtype == "U8":
            dtype = "I8"
        return dtype, shape

    def source_tensors(self, fields, tensors):
        return ["weight", "weight_scale"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(rows["weight"].view(torch.int8), rows["weight_scale"].reshape(-1),
                                   int(fields.get("convrot_groupsize", 256)))

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize: fp32 codes x scales rotated back, then ``dtype``."""
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(tensors["weight"].view(torch.int8),
                                   tensors["weight_scale"].reshape(-1),
                                   int((fields or {}).get("convrot_groupsize", 256)), dtype=dtype)

    def emulated_linear(self, x, tensors, fields, bias=None):
        """``x W^T + b`` as ComfyUI computes it without the int4 kernel (comfy-kitchen's eager
        W4A4 path): x rotated and quantized per token to int4, a matmul of the codes in
        ``x.dtype``, both scales."""
        import torch

        from h3quant.formats.int4_convrot.tensors import w4a4_linear

        return w4a4_linear(x, tensors["weight"].view(torch.int8), tensors["weight_scale"],
                           int((fields or {}).get("convrot_groupsize", 256)), bias)

    def encode(self, w, marker, method, pool=None, calibration=None):
        from h3quant.formats.int4_convrot.tensors import encode_int4_convrot

        q, s = encode_int4_convrot(w, int(marker.get("convrot_groupsize", 256)))
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(out["weight"], out["weight_scale"].reshape(-1),
                                   int(marker.get("convrot_groupsize", 256))), None

    def deep_check(self, tensors, read, fields):
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


CODEC = ConvRotW4A4()
