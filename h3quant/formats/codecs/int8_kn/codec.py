"""``int8_tensorwise_kn``: int8_tensorwise pre-transposed for the NPU (FORMATS.md 9).

Weight ``I8 [K, N]`` (exactly the transpose of the canonical codes), ``weight_scale F32 [N]``,
optional bias; math, rotation and scales are int8_tensorwise's, so this codec is that codec with
the weight stored the other way round. It has no ``convert --to`` target of its own: it is the
``--layout npu`` form of the int8 targets (``layout_of``). The encoder returns canonical row
chunks (``weight`` rows ``[n, K]``); ``transposed_outputs`` tells the writer to transpose them
into the ``[K, N]`` tensor (``h3quant.formats.codecs.int8_kn.tensors.RowTransposer``).
"""

from __future__ import annotations

from h3quant.formats.codecs.int8.codec import NAME as CANONICAL_NAME
from h3quant.formats.codecs.int8.codec import Int8Tensorwise

NAME = "int8_tensorwise_kn"


class Int8TensorwiseKn(Int8Tensorwise):
    name = NAME
    description = ("int8_tensorwise pre-transposed for Ascend npu_quant_matmul: weight [K, N], "
                   "scale [N]")
    targets = ()
    runtime_tensors = ("weight", "weight_scale")
    runtime_required = ("weight", "weight_scale")
    deep_scales = ("weight_scale",)
    transposed_outputs = ("weight",)
    column_sources = ("weight",)
    layout = "npu"
    canonical = CANONICAL_NAME

    def marker(self, target, group_size):
        from h3quant.formats.codecs.int8_kn.tensors import kn_marker

        return kn_marker(convrot=target.convrot, group_size=group_size)

    def logical_shape(self, shape, fields):
        k, n = shape
        return n, k

    def same_target(self, layer, fields, marker):
        convrot = bool(marker.get("convrot"))
        return (fields["format"] == NAME and bool(fields.get("convrot")) == convrot
                and (not convrot or fields.get("convrot_groupsize") == marker["convrot_groupsize"]))

    def planned(self, n, k, marker):
        return {"weight": ("I8", (k, n)), "weight_scale": ("F32", (n,))}

    def keep_declared(self, suffix, dtype, shape, n):
        if suffix == "weight" and dtype == "U8":
            dtype = "I8"
        return dtype, shape

    def source_tensors(self, fields, tensors):
        # the weight is read through column_sources: layer rows are columns of [K, N]
        return ["weight_scale"], []

    def encode(self, w, marker, method, pool=None, calibration=None):
        out = super().encode(w, marker, method, pool, calibration)
        out["weight_scale"] = out["weight_scale"].reshape(-1)
        return out

    def int8_grid(self, tensors, fields):
        import torch

        q = tensors["weight"].t()  # [N, K] view of the stored [K, N]: no copy
        return q, tensors["weight_scale"].to(torch.float32).reshape(-1)


CODEC = Int8TensorwiseKn()
