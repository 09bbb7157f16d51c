"""``nvfp4``: the codec (torch is imported by the tensor methods only)."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, Target, VerifyLimits
from h3quant.formats.nvfp4 import spec
from h3quant.formats.rules.checks import Violation

NAME = spec.NAME


def _first(found: list[Violation]) -> str | None:
    if not found:
        return None
    v = found[0]
    return f"[{v.code}] {v.message}" if v.suffix == "weight" else f"[{v.code}] {v.suffix}: {v.message}"


class NVFP4(Codec):
    name = NAME
    description = spec.DESCRIPTION
    targets = (Target("nvfp4", NAME, False,
                      "fp4 e2m1 with e4m3 block scales per 16 and an fp32 tensor scale"),)
    verify = VerifyLimits(rel_err=0.15, block_sqnr_db=12.0)
    marker_defaults = spec.MARKER_DEFAULTS
    runtime_tensors = ("weight", "weight_scale", "weight_scale_2")
    runtime_required = runtime_tensors
    deep_scales = ("weight_scale_2",)
    chunked = False  # the tensor scale is the whole layer's amax
    unrowed_outputs = ("weight_scale", "weight_scale_2")
    weight_bits = 4
    decodes = True  # the runtime runs it through decode_weight (ComfyUI's dequantizing path)
    kernel = ("nvfp4 scaled_mm (comfy-kitchen TensorCoreNVFP4Layout)", (10, 0))

    def logical_k(self, cols, fields):
        return 2 * cols

    def logical_shape(self, shape, fields):
        return spec.logical_shape(shape, fields)

    def marker(self, target, group_size):
        return {"format": NAME}

    def fit_error(self, layer, fields):
        return _first(spec.rules(fields, layer.tensors))

    def same_target(self, layer, fields, marker):
        return fields["format"] == NAME

    def skip_reason(self, k, marker):
        if k % spec.BLOCK:
            return f"K={k} is not a multiple of {spec.BLOCK} (nvfp4 would pad it)"
        return None

    def planned(self, n, k, marker):
        return spec.planned(n, k)

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix == "weight_scale_2":
            shape = ()
        return dtype, shape

    def source_tensors(self, fields, tensors):
        return ["weight"], ["weight_scale", "weight_scale_2"]

    def row_views(self, whole, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import unswizzle

        raw = whole["weight_scale"]
        raw = raw.view(torch.uint8)
        return {"block_grid": unswizzle(raw, *raw.shape).contiguous()}

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        q = rows["weight"].view(torch.uint8)
        grid = rows.get("block_grid")
        if grid is not None:
            grid = grid[:, :q.shape[1] * 2 // spec.BLOCK].contiguous().view(torch.float8_e4m3fn)
            grid = grid.to(torch.float32)
        return decode_nvfp4(q, whole["weight_scale"], whole["weight_scale_2"], grid=grid)

    def decode_weight(self, tensors, fields, dtype):
        """The weight as comfy-kitchen's dequantize gives it in ``dtype`` (the scale product is
        formed in ``dtype`` too)."""
        import torch

        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        return decode_nvfp4(tensors["weight"].view(torch.uint8), tensors["weight_scale"],
                            tensors["weight_scale_2"], dtype=dtype)

    def encode(self, w, marker, method, pool=None, calibration=None):
        from h3quant.formats.nvfp4.tensors import encode_nvfp4

        return encode_nvfp4(w)

    def report_grid(self, out, marker):
        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        return decode_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"],
                            rows=out.get("__rows__")), None

    def deep_check(self, tensors, read, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import deep_violations

        w, s = tensors.get("weight"), tensors.get("weight_scale")
        if w is None or s is None or len(w.shape) != 2 or len(s.shape) != 2 \
                or s.dtype not in ("F8_E4M3", "U8"):
            return []
        q = read(w, torch.uint8).reshape(w.shape)
        raw = read(s, torch.uint8).reshape(s.shape)
        return [Violation(c, m, sfx) for c, m, sfx in deep_violations(q, raw)]


CODEC = NVFP4()
