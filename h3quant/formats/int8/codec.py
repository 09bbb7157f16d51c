"""``int8_tensorwise``'s tensor work: encode, decode, the int8 grid the runtime multiplies."""

from __future__ import annotations

from h3quant.formats.codec import Codec, Decoder, Encoder, Grid
from h3quant.formats.int8.spec import NAME, SPEC, int8_marker  # noqa: F401  (re-exported)
from h3quant.formats.spec import RowRange


class Int8Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        if tensors["weight_scale"].numel == 1:
            return ["weight"], ["weight_scale"]
        return ["weight", "weight_scale"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.int8.tensors import decode_int8

        q = rows["weight"]
        if "weight_scale" in whole:
            s = whole["weight_scale"].float().reshape(()).expand(q.shape[0], 1)
        else:
            s = rows["weight_scale"].reshape(-1, 1)
        return decode_int8(q, s, convrot=bool(fields.get("convrot")),
                           group_size=fields.get("convrot_groupsize", 256), dtype=torch.float32)


class Int8Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:  # the same scales, codes by error feedback
            from h3quant.formats.int8.tensors import encode_int8_calibrated

            q, s = encode_int8_calibrated(w, calibration, convrot=bool(marker.get("convrot")),
                                          group_size=marker.get("convrot_groupsize", 256),
                                          method=method)
            return {"weight": q, "weight_scale": s.reshape(-1, 1)}
        from h3quant.formats.int8.tensors import encode_int8

        q, s = encode_int8(w, convrot=bool(marker.get("convrot")),
                           group_size=marker.get("convrot_groupsize", 256), per_row=True,
                           method=method)
        return {"weight": q, "weight_scale": s.reshape(-1, 1)}

    def encode_in_dtype(self, w, marker):
        """The per-row encode comfy-kitchen makes from ``w`` in its own dtype (bf16 / f16),
        where it does its arithmetic (``tensors.encode_int8_in_dtype``)."""
        from h3quant.formats.int8.tensors import encode_int8_in_dtype

        q, s = encode_int8_in_dtype(w, convrot=bool(marker.get("convrot")),
                                    group_size=marker.get("convrot_groupsize", 256))
        return {"weight": q, "weight_scale": s.reshape(-1, 1)}

    def report_grid(self, out, marker):
        import torch

        from h3quant.formats.int8.tensors import decode_int8

        convrot, g = bool(marker.get("convrot")), marker.get("convrot_groupsize", 256)
        q, s = out["weight"], out["weight_scale"]
        w_hat = decode_int8(q, s.reshape(-1, 1), convrot=convrot, group_size=g,
                            dtype=torch.float32)
        return w_hat, (q, s, convrot, g)


class Int8Grid(Grid):
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
            return RowRange(True, 126, 128, False, "max|q| = 127 per tensor (126-128 when the "
                            "grid was computed in bf16)")
        # int8 converted from W4A8 through its decoded grid (FORMATS.md 9) keeps W4A8's peaks:
        # the limit is verify's (``th.w4a8_row_peak_min``), handed in by the caller
        low = th.w4a8_row_peak_min
        w4a8_grid = RowRange(False, low, 127, True, f"a W4A8 int8 grid: row peak in [{low}, 127]")
        # comfy-kitchen quantizing bf16 weights rotates and scales in bf16: peaks land on
        # 126-128 (and -128 codes appear), where h3quant's fp32 arithmetic gives 127
        return RowRange(False, 126, 128, False, "max|q| = 127 per row (126-128 when the grid "
                        "was computed in bf16)", alt=w4a8_grid)


CODEC = Codec(SPEC, decoder=Int8Decoder(), encoder=Int8Encoder(), grid=Int8Grid())
