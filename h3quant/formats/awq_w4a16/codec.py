"""``awq_w4a16``: the codec. Reads, checks and decodes; writing needs calibration statistics."""

from __future__ import annotations

from h3quant.errors import UnsupportedError
from h3quant.formats.awq_w4a16 import spec
from h3quant.formats.codecs.base import Codec, Target, VerifyLimits

NAME = spec.NAME


class AWQW4A16(Codec):
    name = NAME
    description = spec.DESCRIPTION
    targets = (Target("awq-w4a16", NAME, False,
                      "AWQ W4A16 (needs calibration statistics; refused without them)"),)
    verify = VerifyLimits(rel_err=0.15, block_sqnr_db=12.0)
    marker_defaults = spec.MARKER_DEFAULTS
    runtime_tensors = ("weight", "weight_scale", "weight_zeros")
    runtime_required = runtime_tensors
    deep_scales = ("weight_scale",)
    column_sources = ("weight_scale", "weight_zeros")  # stored [K/G, N]: row r is column r
    weight_bits = 4
    decodes = True  # the runtime runs it through decode_weight (kitchen's W4A16 math)

    def logical_k(self, cols, fields):
        return 2 * cols

    def logical_shape(self, shape, fields):
        return spec.logical_shape(shape, fields)

    def describe(self, fields):
        return f"{NAME} G={(fields or {}).get('group_size', 64)}"

    def marker(self, target, group_size):
        return {"format": NAME, "group_size": 64}

    def write_refusal(self):
        return spec.REFUSAL

    def fit_error(self, layer, fields):
        found = spec.rules(fields, layer.tensors)
        if not found:
            return None
        v = found[0]
        return f"[{v.code}] {v.message}"

    def same_target(self, layer, fields, marker):
        return fields["format"] == NAME and fields.get("group_size") == marker.get("group_size")

    def planned(self, n, k, marker):
        g = marker.get("group_size", 64)
        return {"weight": ("I8", (n, k // 2)), "weight_scale": ("BF16", (k // g, n)),
                "weight_zeros": ("BF16", (k // g, n))}

    def source_tensors(self, fields, tensors):
        return ["weight"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.awq_w4a16.tensors import decode_awq

        return decode_awq(rows["weight"].view(torch.int8), rows["weight_scale"],
                          rows["weight_zeros"], int(fields.get("group_size", 64)))

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize in ``dtype``: (q - 8) * scale + zero."""
        import torch

        from h3quant.formats.awq_w4a16.tensors import decode_awq

        return decode_awq(tensors["weight"].view(torch.int8), tensors["weight_scale"].t(),
                          tensors["weight_zeros"].t(), int((fields or {}).get("group_size", 64)),
                          dtype=dtype)

    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is None:
            raise UnsupportedError(spec.REFUSAL, code="Q105")
        raise UnsupportedError("writing awq_w4a16 from calibration statistics is not available "
                               "yet", code="Q105")

    def report_grid(self, out, marker):
        raise UnsupportedError(spec.REFUSAL, code="Q105")

    def deep_check(self, tensors, read, fields):
        return []


CODEC = AWQW4A16()
