"""The fp8 codecs: ``float8_e4m3fn`` and ``float8_e5m2`` (one fp32 scale per tensor)."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, Target, VerifyLimits
from h3quant.formats.fp8 import rules
from h3quant.formats.fp8.spec import E4M3, E5M2, Fp8Spec


class Fp8Codec(Codec):
    """A per-tensor-scaled fp8 layer; encodes the whole layer (one amax), in row chunks."""

    quantized = True
    runtime_tensors = ("weight", "weight_scale")
    runtime_required = ("weight", "weight_scale")
    deep_scales = ("weight_scale", "input_scale")
    chunked = False
    unrowed_outputs = ("weight_scale",)
    weight_bits = 8
    decodes = True  # the runtime can run it through its float decode
    kernel = ("fp8 scaled_mm (comfy-kitchen TensorCoreFP8Layout)", (8, 9))  # ComfyUI on CUDA

    def __init__(self, spec: Fp8Spec) -> None:
        self.spec = spec
        self.name = spec.name
        self.description = spec.help
        self.targets = (Target(spec.target, spec.name, False, spec.help),)
        self.verify = VerifyLimits(rel_err=spec.verify_rel_err,
                                   block_sqnr_db=spec.verify_block_sqnr_db)
        self.marker_defaults = dict(spec.marker_defaults)

    def _dtype(self):
        import torch

        return getattr(torch, self.spec.torch_dtype)

    def marker(self, target, group_size):
        return {"format": self.name}

    def violations(self, tensors: dict, fields: dict | None = None):
        return rules.fp8_violations(self.name, self.spec.code_dtype, tensors)

    def fit_error(self, layer, fields):
        return rules.first(self.violations(layer.tensors, fields))

    def same_target(self, layer, fields, marker):
        s = layer.tensors.get("weight_scale")
        return fields["format"] == self.name and s is not None and s.numel == 1

    def planned(self, n, k, marker):
        return {"weight": (self.spec.code_dtype, (n, k)), "weight_scale": ("F32", ())}

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
        """The weight as ComfyUI's CPU path computes with it (kitchen's dequantize to ``dtype``)."""
        from h3quant.formats.fp8.tensors import decode_fp8

        s = tensors["weight_scale"].float()
        s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
        return decode_fp8(tensors["weight"], s, dtype)

    def encode(self, w, marker, method, pool=None):
        from h3quant.formats.fp8.tensors import encode_fp8

        q, s = encode_fp8(w, self._dtype(), pool=pool)
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        import torch

        from h3quant.formats.fp8.tensors import decode_fp8

        return decode_fp8(out["weight"], out["weight_scale"], torch.float32), None

    def value_violations(self, tensors: dict) -> list:
        """Data rules over loaded tensors (verify): scales finite and > 0, codes finite."""
        from h3quant.formats.rules.checks import scale_violations

        out = [v for s in ("weight_scale", "input_scale") if s in tensors
               for v in scale_violations(tensors[s])]
        v = rules.nonfinite_codes(tensors["weight"])
        return out + ([v] if v is not None else [])

    def deep_findings(self, read, tensors: dict) -> list:
        """Data rules beyond the scales: D130 for codes that decode to NaN or infinity."""
        w = tensors.get("weight")
        if w is None or w.dtype != self.spec.code_dtype:
            return []
        out = []
        for chunk in read(w, self._dtype()):
            v = rules.nonfinite_codes(chunk)
            if v is not None:
                out.append(v)
                break
        return out


E4M3_CODEC = Fp8Codec(E4M3)
E5M2_CODEC = Fp8Codec(E5M2)
CODECS = (E4M3_CODEC, E5M2_CODEC)
CODEC = E4M3_CODEC
