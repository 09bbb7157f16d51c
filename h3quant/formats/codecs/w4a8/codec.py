"""``asym_w4a8_int8``: 4-bit codes (two per byte), e4m3 group scales, fp32 row scales, ConvRot."""

from __future__ import annotations

from h3quant.formats.codecs.base import Codec, RowRange, Target, VerifyLimits
from h3quant.formats.rules.checks import fit_error as rules_fit_error

NAME = "asym_w4a8_int8"
GROUP = 16  # the group size h3quant writes (ComfyUI's default)


def w4a8_marker(group_size: int = GROUP, convrot_groupsize: int = 256) -> dict:
    """The canonical per-layer marker object (key order matters for the written bytes); here,
    torch-free, so planning a W4A8 conversion does not import torch."""
    return {"format": NAME, "group_size": group_size, "convrot_groupsize": convrot_groupsize}


class AsymW4A8Int8(Codec):
    name = NAME
    description = "4-bit codes (two per byte) + e4m3 group scales + fp32 row scales, ConvRot always on"
    targets = (Target("w4a8", NAME, True, "4-bit weights with e4m3 group scales (ConvRot)"),)
    verify = VerifyLimits(rel_err=0.12, block_sqnr_db=8.0)
    marker_defaults = {"group_size": GROUP, "convrot_groupsize": 256, "convrot": True}
    runtime_tensors = ("weight", "weight_s_rel", "weight_s_channel", "weight_codebook")
    runtime_required = ("weight", "weight_s_rel", "weight_s_channel")
    deep_scales = ("weight_s_rel", "weight_s_channel")
    chunked = False  # the codebook is chosen per layer
    unrowed_outputs = ("weight_codebook",)
    always_convrot = True
    weight_bits = 4

    def logical_k(self, cols, fields):
        return 2 * cols

    def describe(self, fields):
        f = fields or {}
        return f"{NAME} G={f.get('group_size', GROUP)} g={f.get('convrot_groupsize', 256)}"

    def marker(self, target, group_size):
        return w4a8_marker(group_size=GROUP, convrot_groupsize=group_size)

    def fit_error(self, layer, fields):
        return rules_fit_error(NAME, layer, fields)

    def same_target(self, layer, fields, marker):
        return (fields["format"] == NAME and fields.get("group_size") == marker["group_size"]
                and fields.get("convrot_groupsize") == marker["convrot_groupsize"])

    def skip_reason(self, k, marker):
        g, cg = marker["group_size"], marker["convrot_groupsize"]
        if k % g or k % cg:
            return f"K={k} is not divisible by {g} and the group size {cg}"
        return None

    def planned(self, n, k, marker):
        return {"weight": ("I8", (n, k // 2)),
                "weight_s_rel": ("F8_E4M3", (n, k // marker["group_size"])),
                "weight_s_channel": ("F32", (n,)), "weight_codebook": ("F32", (16,))}

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix in ("weight", "weight_s_rel") and dtype == "U8":
            dtype = "I8" if suffix == "weight" else "F8_E4M3"
        if suffix == "weight_s_channel":
            shape = (n,)
        return dtype, shape

    def source_tensors(self, fields, tensors):
        whole = ["weight_codebook"] if "weight_codebook" in tensors else []
        return ["weight", "weight_s_rel", "weight_s_channel"], whole

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.codecs.w4a8.tensors import decode_w4a8

        local = {"weight": rows["weight"].view(torch.int8), "weight_s_rel": rows["weight_s_rel"],
                 "weight_s_channel": rows["weight_s_channel"].reshape(-1)}
        if "weight_codebook" in whole:
            local["weight_codebook"] = whole["weight_codebook"]
        return decode_w4a8(local, group_size=fields.get("group_size", GROUP),
                           convrot_groupsize=fields.get("convrot_groupsize", 256),
                           dtype=torch.float32)

    calibrates = True

    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:
            from h3quant.formats.codecs.w4a8.calibrated import encode_w4a8_calibrated

            return encode_w4a8_calibrated(w, calibration, group_size=marker["group_size"],
                                          convrot_groupsize=marker["convrot_groupsize"],
                                          codebook="auto", pool=pool)
        from h3quant.formats.codecs.w4a8.tensors import encode_w4a8

        return encode_w4a8(w, group_size=marker["group_size"],
                           convrot_groupsize=marker["convrot_groupsize"], codebook="auto",
                           pool=pool)

    def report_grid(self, out, marker):
        from h3quant.formats.codecs.w4a8.tensors import decode_w4a8, decode_w4a8_int8

        local = {s: out[s] for s in ("weight", "weight_s_rel", "weight_s_channel")}
        cb = out.get("weight_codebook")
        if cb is not None:
            local["weight_codebook"] = cb
        g, cg = marker.get("group_size", GROUP), marker.get("convrot_groupsize", 256)
        w_hat = decode_w4a8(local, group_size=g, convrot_groupsize=cg)
        q = decode_w4a8_int8(out["weight"], out["weight_s_rel"], group_size=g, codebook=cb)
        return w_hat, (q, out["weight_s_channel"], True, cg)

    def int8_grid(self, tensors, fields):
        import torch

        from h3quant.formats.codecs.w4a8.tensors import decode_w4a8_int8

        q = decode_w4a8_int8(tensors["weight"], tensors["weight_s_rel"],
                             group_size=int(fields["group_size"]),
                             codebook=tensors.get("weight_codebook"))
        return q, tensors["weight_s_channel"].to(torch.float32).reshape(-1)

    def row_range(self, tensors, th):
        """The decoded grid of a well-encoded row peaks near 127 (``th.w4a8_row_peak_min``)."""
        low = th.w4a8_row_peak_min
        return RowRange(False, low, 127, False, f"row peak in [{low}, 127]")


CODEC = AsymW4A8Int8()
