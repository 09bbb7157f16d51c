"""``convrot_w4a4`` (INT4 ConvRot): the codec (torch is imported by the tensor methods only)."""

from __future__ import annotations

from h3quant.formats.codec import Checks, Codec, DecodedGrid, Decoder, Emulator, Encoder
from h3quant.formats.int4_convrot.spec import ALIAS_SPEC, SPEC
from h3quant.formats.spec import Violation


def _g(fields) -> int:
    return int((fields or {}).get("convrot_groupsize", 256))


class ConvRotW4A4Decoder(Decoder):
    def source_tensors(self, fields, tensors):
        return ["weight", "weight_scale"], []

    def decode_rows(self, rows, whole, fields):
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(rows["weight"].view(torch.int8), rows["weight_scale"].reshape(-1),
                                   _g(fields))

    def decode_weight(self, tensors, fields, dtype):
        """comfy-kitchen's dequantize: fp32 codes x scales rotated back, then ``dtype``."""
        import torch

        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(tensors["weight"].view(torch.int8),
                                   tensors["weight_scale"].reshape(-1), _g(fields), dtype=dtype)


class ConvRotW4A4Emulator(Emulator):
    def kernel_route(self, fields, capability):
        """(activation bits, what runs) for a layer under ``fields`` in comfy-kitchen 0.2.40's
        CUDA ``convrot_w4a4_linear`` on a GPU of compute ``capability`` (major, minor), for
        inputs of more than 8 tokens: ``linear_dtype: int8`` always takes the int8-activation
        GEMM (per-token int8, rotated; int4 weight codes); ``int4`` takes the int4 MMA on sm_8x
        and Turing's int4 kernel on sm_75, and the same int8-activation GEMM on every other GPU
        (Hopper and newer: the marker does not matter there)."""
        major, minor = (int(c) for c in capability)
        if (fields or {}).get("linear_dtype", "int4") == "int8":
            return 8, "int4-weight int8-activation GEMM (linear_dtype int8)"
        if major == 8:
            return 4, "int4 MMA"
        if (major, minor) == (7, 5):
            return 4, "Turing int4 kernel"
        return 8, f"int4-weight int8-activation GEMM (no int4 MMA route on sm_{major}{minor})"

    def emulated_linear(self, x, tensors, fields, bias=None, capability=None):
        """``x W^T + b`` as ComfyUI computes it without the int4 kernel (comfy-kitchen's eager
        W4A4 path, which ignores ``linear_dtype``): x rotated and quantized per token to int4, a
        matmul of the codes in ``x.dtype``, both scales. With ``capability``: as kitchen's CUDA
        kernels compute it on that GPU (``kernel_route``; its int4 route is the same arithmetic
        as the eager path)."""
        import torch

        from h3quant.formats.int4_convrot.tensors import w4a4_linear, w4a8_linear

        bits = 4 if capability is None else self.kernel_route(fields, capability)[0]
        run = w4a4_linear if bits == 4 else w4a8_linear
        return run(x, tensors["weight"].view(torch.int8), tensors["weight_scale"], _g(fields), bias)

    def rounded_inputs(self, x, fields, capability=None):
        """(``x`` in the ConvRot basis, the same rounded per token), fp32: what
        ``emulated_linear`` (with the same ``capability``) multiplies the codes with."""
        from h3quant.formats.int4_convrot.tensors import rounded_activations

        bits = 4 if capability is None else self.kernel_route(fields, capability)[0]
        return rounded_activations(x, _g(fields), bits)


class ConvRotW4A4Encoder(Encoder):
    def encode(self, w, marker, method, pool=None, calibration=None):
        if calibration is not None:  # the same rotation and scales, codes by error feedback
            from h3quant.formats.int4_convrot.calibrated import encode_int4_convrot_calibrated

            q, s = encode_int4_convrot_calibrated(w, calibration, _g(marker))
            return {"weight": q, "weight_scale": s}
        from h3quant.formats.int4_convrot.tensors import encode_int4_convrot

        q, s = encode_int4_convrot(w, _g(marker))
        return {"weight": q, "weight_scale": s}

    def report_grid(self, out, marker):
        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(out["weight"], out["weight_scale"].reshape(-1), _g(marker)), None


class ConvRotW4A4Checks(Checks):
    def layer_data_violations(self, tensors, read, fields):
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


def _codec(spec):
    return Codec(spec, decoder=ConvRotW4A4Decoder(), encoder=ConvRotW4A4Encoder(),
                 grid=DecodedGrid(), emulator=ConvRotW4A4Emulator(), checks=ConvRotW4A4Checks())


CODEC = _codec(SPEC)
ALIAS_CODEC = _codec(ALIAS_SPEC)  # int4_tensorwise: the same tensor work
