"""``int8_tensorwise``: int8 weight [N, K] with per-row (or one) fp32 scale, optionally ConvRot."""

from __future__ import annotations

from h3quant.convrot import check_group_size
from h3quant.formats.codecs.base import Codec, RowRange, Target, VerifyLimits
from h3quant.formats.rules.checks import fit_error as rules_fit_error

NAME = "int8_tensorwise"


def int8_marker(convrot: bool = True, group_size: int = 256) -> dict:
    """The canonical ``.comfy_quant`` dict h3quant writes (key order is part of the bytes).
    Torch-free: ``convert`` plans (and starts writing) before torch is loaded."""
    if not convrot:
        return {"format": NAME}
    check_group_size(group_size)
    return {"format": NAME, "convrot": True, "convrot_groupsize": int(group_size)}


class Int8Tensorwise(Codec):
    name = NAME
    description = "int8 weight with per-row (or tensorwise) fp32 scale, optional ConvRot"
    targets = (
        Target("int8-convrot", NAME, True, "int8 with ConvRot rotation (per-row scales)"),
        Target("int8", NAME, False, "int8 without rotation (per-row scales)"),
    )
    verify = VerifyLimits(rel_err=0.05, block_sqnr_db=20.0)
    marker_defaults = {"convrot": False, "convrot_groupsize": 256}
    runtime_tensors = ("weight", "weight_scale")
    runtime_required = ("weight", "weight_scale")
    deep_scales = ("weight_scale", "input_scale")
    weight_bits = 8

    def describe(self, fields):
        if fields and fields.get("convrot"):
            return f"{self.name} convrot g={fields.get('convrot_groupsize', 256)}"
        return self.name

    def marker(self, target, group_size):
        return int8_marker(convrot=target.convrot, group_size=group_size)

    def fit_error(self, layer, fields):
        return rules_fit_error(self.name, layer, fields)

    def same_target(self, layer, fields, marker):
        convrot = bool(marker.get("convrot"))
        return (fields["format"] == NAME and bool(fields.get("convrot")) == convrot
                and (not convrot or fields.get("convrot_groupsize") == marker["convrot_groupsize"])
                and layer.tensors["weight_scale"].numel == layer.weight.shape[0])

    def skip_reason(self, k, marker):
        g = marker.get("convrot_groupsize")
        if marker.get("convrot") and k % g:
            return f"K={k} is not divisible by the group size {g}"
        return None

    def planned(self, n, k, marker):
        return {"weight": ("I8", (n, k)), "weight_scale": ("F32", (n, 1))}

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix == "weight" and dtype == "U8":
            dtype = "I8"
        if suffix == "weight_scale":
            shape = (n, 1)
        return dtype, shape

    def source_tensors(self, fields, tensors):
        if tensors["weight_scale"].numel == 1:
            return ["weight"], ["weight_scale"]
        return ["weight", "weight_scale"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.codecs.int8.tensors import decode_int8

        q = rows["weight"]
        if "weight_scale" in whole:
            s = whole["weight_scale"].float().reshape(()).expand(q.shape[0], 1)
        else:
            s = rows["weight_scale"].reshape(-1, 1)
        return decode_int8(q, s, convrot=bool(fields.get("convrot")),
                           group_size=fields.get("convrot_groupsize", 256), dtype=torch.float32)

    calibrates = True

    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:
            from h3quant.formats.codecs.int8.tensors import encode_int8_calibrated

            q, s = encode_int8_calibrated(w, calibration, convrot=bool(marker.get("convrot")),
                                          group_size=marker.get("convrot_groupsize", 256),
                                          method=method)
            return {"weight": q, "weight_scale": s.reshape(-1, 1)}
        from h3quant.formats.codecs.int8.tensors import encode_int8

        q, s = encode_int8(w, convrot=bool(marker.get("convrot")),
                           group_size=marker.get("convrot_groupsize", 256), per_row=True,
                           method=method)
        return {"weight": q, "weight_scale": s.reshape(-1, 1)}

    def report_grid(self, out, marker):
        import torch

        from h3quant.formats.codecs.int8.tensors import decode_int8

        convrot, g = bool(marker.get("convrot")), marker.get("convrot_groupsize", 256)
        q, s = out["weight"], out["weight_scale"]
        w_hat = decode_int8(q, s.reshape(-1, 1), convrot=convrot, group_size=g,
                            dtype=torch.float32)
        return w_hat, (q, s, convrot, g)

    def int8_grid(self, tensors, fields):
        import torch

        s = tensors["weight_scale"].to(torch.float32).reshape(-1)
        q = tensors["weight"]
        if s.numel() == 1:
            s = s.expand(q.shape[0]).contiguous()
        return q, s

    def runtime_weights(self, tensors, grid):
        """The stored codes and the stored scale tensor in its stored shape ([N, 1], [N] or [])."""
        import torch

        stored = tensors["weight_scale"]
        return grid[0], stored if stored.dtype == torch.float32 else stored.to(torch.float32)

    def row_range(self, tensors, th):
        if tensors["weight_scale"].numel() == 1:  # one scale: one peak for the whole tensor
            return RowRange(True, 127, 127, True, "max|q| = 127 per tensor")
        # int8 converted from W4A8 through its decoded grid (FORMATS.md 9) keeps W4A8's peaks
        low = th.w4a8_row_peak_min
        w4a8_grid = RowRange(False, low, 127, True, f"a W4A8 int8 grid: row peak in [{low}, 127]")
        return RowRange(False, 127, 127, True, "max|q| = 127 per row", alt=w4a8_grid)


CODEC = Int8Tensorwise()
