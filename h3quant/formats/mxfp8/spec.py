"""What an ``mxfp8`` layer stores, as data (torch-free).

Facts (docs/FORMATS.md 17.2): comfy-kitchen ``tensor/mxfp8.py`` (``TensorCoreMXFP8Layout``:
``weight`` e4m3, ``weight_scale`` e8m0 per block of 32 along K in cuBLAS's blocked layout;
``get_padded_shape`` rounds both weight dims up to 32) and ``backends/eager/quantization.py``
(``quantize_mxfp8``; ``to_blocked`` pads the [N, K/32] scales to [roundup(N, 128),
roundup(K/32, 4)]); ComfyUI ``comfy/ops.py`` reads ``weight_scale`` as uint8 bytes viewed as
``float8_e8m0fnu``.
"""

from __future__ import annotations


from h3quant.formats.fp8 import rules
from h3quant.formats.spec import FormatSpec, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (
    BIAS,
    Target,
    TensorSpec,
    VerifyLimits,
    Violation,
    scalar,
    shape_of,
)
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q130", "mxfp8-shape", Severity.ERROR,
         "mxfp8: weight dims are multiples of 32 and weight_scale is the "
         "blocked [roundup(N, 128), roundup(K/32, 4)] of that weight")
register("D131", "e8m0-scale-nan", Severity.ERROR,
         "mxfp8 e8m0 block scales are not 0xFF (NaN)")

NAME = "mxfp8"
BLOCK = 32
TILE = (128, 4)  # the scales' blocked tile (rows, scale columns)


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """The stored shape of the block scales of an [N, K] weight (K a multiple of 32)."""
    return roundup(n, TILE[0]), roundup(k // BLOCK, TILE[1])


def mxfp8_shape_violations(tensors: dict) -> list[Violation]:
    """Q130: the padded shapes of an mxfp8 layer (weight dims, blocked scale shape)."""
    w = tensors.get("weight")
    if w is None or len(shape_of(w)) != 2:
        return []
    n, k = shape_of(w)
    if n % BLOCK or k % BLOCK:
        return [Violation("Q130", f"weight is [{n}, {k}]: mxfp8 stores weights padded to "
                          f"multiples of {BLOCK} in both dims")]
    s = tensors.get("weight_scale")
    want = scale_shape(n, k)
    if s is not None and shape_of(s) != want:
        return [Violation("Q130", f"weight_scale is {list(shape_of(s))}, expected the blocked "
                          f"layout [roundup(N, 128), roundup(K/32, 4)] = {list(want)} for "
                          f"N={n}, K={k}", "weight_scale")]
    return []


def mxfp8_violations(tensors: dict) -> list[Violation]:
    """Rules of an mxfp8 layer beyond its weight's dtype and rank."""
    out = rules.input_scale_violations(tensors)
    s = tensors.get("weight_scale")
    if s is None:
        return out + [Violation("Q101", "mxfp8 layer has no weight_scale", "weight_scale")]
    if s.dtype not in ("F8_E8M0", "U8"):
        out.append(Violation("Q102", f"weight_scale is {s.dtype}, expected F8_E8M0 (or U8 "
                             "bytes)", "weight_scale"))
    return out + mxfp8_shape_violations(tensors)



class MxPlanning(PlanningFacet):
    """planning."""

    def marker(self, target, group_size):
        return {"format": self.spec.name}

    def same_target(self, layer, fields, marker):
        return fields["format"] == self.spec.name

    def skip_reason(self, k, marker):
        return f"K={k} is not a multiple of {BLOCK} (mxfp8 blocks)" if k % BLOCK else None

    def planned(self, n, k, marker):
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F8_E8M0", scale_shape(n, k))}

    def keep_declared(self, suffix, dtype, shape, n):
        return ("F8_E8M0" if suffix == "weight_scale" and dtype == "U8" else dtype), shape


class MxRules(RulesFacet):
    """rules."""

    def tensor_violations(self, n, cols, fields, tensors):
        return n, cols, mxfp8_violations(tensors)

    def combination_violations(self, fields, tensors):
        return mxfp8_shape_violations(tensors)  # Q130 (validate: beside Q103)


TEXT = "fp8 e4m3 codes with an e8m0 (power-of-two) scale per 32 values (ComfyUI's mxfp8)"
SPEC = FormatSpec(
    name=NAME, description=TEXT,
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("F8_E4M3",), lambda n, k, f: [(n, k)],
                       "[N, K], N and K multiples of 32"),
            TensorSpec("weight_scale", ("F8_E8M0", "U8"), lambda n, k, f: [scale_shape(n, k)],
                       "[roundup(N, 128), roundup(K/32, 4)] (blocked 128x4 tiles)"),
            TensorSpec("input_scale", ("F32",), scalar, "[]", required=False),
            BIAS,
        ),
        marker_defaults={"full_precision_matrix_mult": False},
    ),
    encoding=EncodingFacet(
        targets=(Target(NAME, NAME, False, TEXT),),
        chunked=False,  # the blocked scales hold 128 rows per tile: chunks of 128-row multiples
        streamed=True,
        chunk_rows=128,
        unrowed_outputs=("weight_scale",),
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts("TensorCoreMXFP8Layout", (10, 0), "0.2.8"),
        tensors=("weight", "weight_scale", "input_scale"),
        required=("weight", "weight_scale"),
        decodes=True,  # the runtime runs it through its float decode
        kernel=("mxfp8 block-scaled mm (comfy-kitchen TensorCoreMXFP8Layout)", (10, 0)),
        needs_row0=True,  # decode_rows gets the chunk's first row (blocked scales)
    ),
    verify=VerifyFacet(
        # tiny synthetic H3: layers 0.027, blocks 19-21 dB (FORMATS.md 17.4)
        limits=VerifyLimits(0.06, 16.0),
        deep_scales=("input_scale",),  # the e8m0 block scales have their own rule (D131)
        weight_bits=8,
    ),
    planning=MxPlanning(),
    rules=MxRules(),
)
