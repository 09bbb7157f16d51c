"""``nvfp4``: the codec (torch is imported by the tensor methods only)."""

from __future__ import annotations

from h3quant.formats.codec import Checks, Codec, DecodedGrid, Decoder, Encoder
from h3quant.formats.nvfp4.spec import BLOCK, SPEC
from h3quant.formats.spec import Violation


class NVFP4Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        return ["weight"], ["weight_scale", "weight_scale_2"]

    def row_views(self, whole, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import unswizzle

        raw = whole["weight_scale"].view(torch.uint8)
        return {"block_grid": unswizzle(raw, *raw.shape).contiguous()}

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        q = rows["weight"].view(torch.uint8)
        grid = rows.get("block_grid")
        if grid is None and "_row0" in rows:  # the first row's index instead of the views
            grid = self.row_views(whole, fields)["block_grid"]
            grid = grid[rows["_row0"]:rows["_row0"] + q.shape[0]]
        if grid is not None:
            grid = grid[:, :q.shape[1] * 2 // BLOCK].contiguous().view(torch.float8_e4m3fn)
            grid = grid.to(torch.float32)
        return decode_nvfp4(q, whole["weight_scale"], whole["weight_scale_2"], grid=grid)

    def decode_weight(self, tensors, fields, dtype):
        """The weight as comfy-kitchen's dequantize gives it in ``dtype`` (the scale product is
        formed in ``dtype`` too)."""
        import torch

        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        return decode_nvfp4(tensors["weight"].view(torch.uint8), tensors["weight_scale"],
                            tensors["weight_scale_2"], dtype=dtype)


class NVFP4Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:  # the same scales, e2m1 codes by error feedback
            from h3quant.formats.nvfp4.calibrated import encode_nvfp4_calibrated

            return encode_nvfp4_calibrated(w, calibration)
        from h3quant.formats.nvfp4.tensors import encode_nvfp4

        return encode_nvfp4(w)

    def scan_rows(self, w):
        from h3quant.formats.nvfp4.tensors import amax_of

        return amax_of(w)

    def layer_value(self, parts):
        import torch

        from h3quant.formats.nvfp4.tensors import scale_from_amax

        return scale_from_amax(torch.stack(parts).amax())

    def encode_rows(self, w, marker, method, value):
        from h3quant.formats.nvfp4.tensors import encode_nvfp4

        return encode_nvfp4(w, scale=value)

    def report_grid(self, out, marker):
        from h3quant.formats.nvfp4.tensors import decode_nvfp4

        return decode_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"],
                            rows=out.get("_rows")), None


class NVFP4Checks(Checks):
    def layer_data_violations(self, tensors, read, fields):
        import torch

        from h3quant.formats.nvfp4.tensors import deep_violations

        w, s = tensors.get("weight"), tensors.get("weight_scale")
        if w is None or s is None or len(w.shape) != 2 or len(s.shape) != 2 \
                or s.dtype not in ("F8_E4M3", "U8") or w.dtype != "U8":
            return []
        q = read(w, torch.uint8).reshape(w.shape)
        raw = read(s, torch.uint8).reshape(s.shape)
        return [Violation(c, m, sfx) for c, m, sfx in deep_violations(q, raw)]


CODEC = Codec(SPEC, decoder=NVFP4Decoder(), encoder=NVFP4Encoder(), grid=DecodedGrid(),
              checks=NVFP4Checks())
