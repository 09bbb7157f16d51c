"""``int8_tensorwise_kn``: int8_tensorwise pre-transposed for the NPU (FORMATS.md 9).

Weight ``I8 [K, N]`` (exactly the transpose of the canonical codes), ``weight_scale F32 [N]``,
optional bias; math, rotation and scales are int8_tensorwise's, so this format is that format
with the weight stored the other way round. It has no ``convert --to`` target of its own: it is
the ``--layout npu`` form of the int8 targets. ComfyUI does not know it (so it refuses such
files instead of mis-reading them).
"""

from __future__ import annotations

from h3quant.formats.int8.spec import NAME as CANONICAL_NAME
from h3quant.formats.int8.spec import SPEC as INT8_SPEC
from h3quant.formats.int8.spec import Int8Planning, Int8Reading, Int8Rules
from h3quant.formats.int8_kn.tensors import check_kn, kn_marker
from h3quant.formats.spec import FormatSpec
from h3quant.formats.spec import EncodingFacet, RelayoutFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import BIAS, SCALE_DTYPES, TensorSpec, Violation, shape_of
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q109", "kn-scale-shape", Severity.ERROR,
         "int8_tensorwise_kn: weight I8 [K, N] and weight_scale F32 [N] "
         "agree on N")
register("Q110", "kn-nz-ineligible", Severity.INFO,
         "int8_tensorwise_kn: K % 16 == 0 and N % 32 == 0, else the NPU "
         "keeps the weight ND (no FRACTAL_NZ cast)")
register("Q111", "kn-npu-n-limit", Severity.WARNING,
         "int8_tensorwise_kn: N <= 65535 per rank (npu_quant_matmul's "
         "limit), else the layer needs tensor parallelism")
register("D107", "kn-orientation", Severity.ERROR,
         "int8_tensorwise_kn: the [K, N] weight is not canonical [N, K] "
         "codes under the kn name (every row peaking at |q| = 127 while output channels do not; a "
         "square layer's shape cannot tell)")

NAME = "int8_tensorwise_kn"


class Int8KnPlanning(Int8Planning):
    """The kn layout: what convert plans for it."""

    def marker(self, target, group_size):
        return kn_marker(convrot=target.convrot, group_size=group_size)

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


class Int8KnRules(Int8Rules):
    """The kn layout: its header rules."""

    def tensor_violations(self, n, cols, fields, tensors):
        k, n = n, cols
        out: list[Violation] = []
        s = tensors.get("weight_scale")
        if s is None:
            out.append(Violation("Q101", f"{self.spec.name} layer has no weight_scale", "weight_scale"))
        elif s.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F32", "weight_scale"))
        elif shape_of(s) != (n,):
            out.append(Violation("Q109", f"weight_scale is {list(shape_of(s))}, expected F32 "
                                 f"[{n}] for a [K, N] = [{k}, {n}] kn weight", "weight_scale"))
        return n, k, out

    def combination_violations(self, fields, tensors):
        return []

    def skip_shape(self, suffix, layer):
        return suffix == "weight_scale"  # judged against the weight by check_kn (Q109)

    def header_findings(self, layer, n, k, add):
        return check_kn(layer, n, k, file=str(layer.weight.file))


SPEC = FormatSpec(
    name=NAME,
    description="int8_tensorwise pre-transposed for Ascend npu_quant_matmul: weight [K, N], "
                "scale [N]",
    comfy=False,
    layout="npu",
    canonical=CANONICAL_NAME,
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(k, n)], "[K, N]"),
            TensorSpec("weight_scale", ("F32",), lambda n, k, f: [(n,)], "[N]"),
            BIAS,
        ),
        marker_defaults=dict(INT8_SPEC.storage.marker_defaults),
        convrot_rules=True,
        transposed_outputs=("weight",),
        column_sources=("weight",),
    ),
    encoding=EncodingFacet(
        calibrates=INT8_SPEC.encoding.calibrates,
    ),
    relayout=RelayoutFacet(
        int8_codes=True,
        row_scale=INT8_SPEC.relayout.row_scale,
        relayout_note=INT8_SPEC.relayout.relayout_note,
    ),
    runtime=RuntimeFacet(
        load_note=("ComfyUI refuses it (a format name it does not register); only h3quant's own "
                   "runtime runs it (verify, compare). For ComfyUI on Ascend make the canonical int8 "
                   "layout (convert --to int8-convrot, without --layout npu)"),
        tensors=("weight", "weight_scale"),
        required=("weight", "weight_scale"),
    ),
    verify=VerifyFacet(
        limits=INT8_SPEC.verify.limits,
        deep_scales=("weight_scale",),
        deep_whole=("weight",),  # the per-channel peak rule (D107): one orientation, one verdict
        weight_bits=8,
    ),
    reading=Int8Reading(),
    planning=Int8KnPlanning(),
    rules=Int8KnRules(),
)
