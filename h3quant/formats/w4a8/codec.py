"""``asym_w4a8_int8``'s tensor work: encode (codebook per layer), decode, its int8 grid."""

from __future__ import annotations

from h3quant.formats.codec import Checks, Codec, Decoder, Encoder, Grid
from h3quant.formats.spec import RowRange
from h3quant.formats.w4a8.spec import GROUP, NAME, SPEC, w4a8_marker  # noqa: F401  (re-exported)


class W4A8Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        whole = ["weight_codebook"] if "weight_codebook" in tensors else []
        return ["weight", "weight_s_rel", "weight_s_channel"], whole

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.w4a8.tensors import decode_w4a8

        local = {"weight": rows["weight"].view(torch.int8), "weight_s_rel": rows["weight_s_rel"],
                 "weight_s_channel": rows["weight_s_channel"].reshape(-1)}
        if "weight_codebook" in whole:
            local["weight_codebook"] = whole["weight_codebook"]
        return decode_w4a8(local, group_size=fields.get("group_size", GROUP),
                           convrot_groupsize=fields.get("convrot_groupsize", 256),
                           dtype=torch.float32)


class W4A8Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:  # the codebook and scales as always, codes by feedback
            from h3quant.formats.w4a8.calibrated import encode_w4a8_calibrated

            return encode_w4a8_calibrated(w, calibration, group_size=marker["group_size"],
                                          convrot_groupsize=marker["convrot_groupsize"],
                                          codebook="auto", pool=pool)
        from h3quant.formats.w4a8.tensors import encode_w4a8

        return encode_w4a8(w, group_size=marker["group_size"],
                           convrot_groupsize=marker["convrot_groupsize"], codebook="auto",
                           pool=pool)

    def report_grid(self, out, marker):
        from h3quant.formats.w4a8.tensors import decode_w4a8, decode_w4a8_int8

        local = {s: out[s] for s in ("weight", "weight_s_rel", "weight_s_channel")}
        cb = out.get("weight_codebook")
        if cb is not None:
            local["weight_codebook"] = cb
        g, cg = marker.get("group_size", GROUP), marker.get("convrot_groupsize", 256)
        w_hat = decode_w4a8(local, group_size=g, convrot_groupsize=cg)
        q = decode_w4a8_int8(out["weight"], out["weight_s_rel"], group_size=g, codebook=cb)
        return w_hat, (q, out["weight_s_channel"], True, cg)


class W4A8Grid(Grid):
    def int8_grid(self, tensors, fields):
        import torch

        from h3quant.formats.w4a8.tensors import decode_w4a8_int8

        q = decode_w4a8_int8(tensors["weight"], tensors["weight_s_rel"],
                             group_size=int(fields["group_size"]),
                             codebook=tensors.get("weight_codebook"))
        return q, tensors["weight_s_channel"].to(torch.float32).reshape(-1)

    def grid_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.w4a8.tensors import decode_w4a8_int8

        return decode_w4a8_int8(rows["weight"].view(torch.int8), rows["weight_s_rel"],
                                group_size=int(fields.get("group_size", GROUP)),
                                codebook=whole.get("weight_codebook"))

    def grid_origin(self, q):
        from h3quant.formats.w4a8.grid import grid_origin

        return grid_origin(q)

    def row_range(self, tensors, th):
        """The decoded grid of a well-encoded row peaks near 127 (``th.w4a8_row_peak_min``)."""
        low = th.w4a8_row_peak_min
        return RowRange(False, low, 127, False, f"row peak in [{low}, 127]")


class W4A8Checks(Checks):
    def data_violation(self, suffix, values):
        if suffix != "weight_codebook":
            return None
        from h3quant.formats.w4a8.codebook import codebook_violation

        return codebook_violation(values)


CODEC = Codec(SPEC, decoder=W4A8Decoder(), encoder=W4A8Encoder(), grid=W4A8Grid(),
              checks=W4A8Checks())
