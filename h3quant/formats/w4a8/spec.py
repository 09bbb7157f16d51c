"""``asym_w4a8_int8``: 4-bit codes (two per byte), e4m3 group scales, fp32 row scales, ConvRot."""

from __future__ import annotations

from h3quant.formats.spec import FormatSpec, ReadingFacet, PlanningFacet, RulesFacet
from h3quant.formats.spec import EncodingFacet, RelayoutFacet, RuntimeFacet, StorageFacet, VerifyFacet
from h3quant.formats.spec import KitchenFacts
from h3quant.formats.spec import (
    BIAS,
    FLOATS,
    SCALE_DTYPES,
    TensorSpec,
    Target,
    VerifyLimits,
    Violation,
    shape_of,
)
from h3quant.findings import Severity, register

# The finding codes this format's rules report (``validate --codes`` lists them).
register("Q108", "k-divisibility", Severity.ERROR,
         "W4A8: group_size is >= 4 and divides 16 or is a multiple of 16; "
         "K is divisible by 16 and by group_size")
register("D104", "codebook", Severity.ERROR,
         "a codebook has 16 sorted finite levels in [-1, 1]")

NAME = "asym_w4a8_int8"
GROUP = 16  # the group size h3quant writes (ComfyUI's default)
S_REL_DTYPES = ("F8_E4M3", "U8")


def w4a8_channel_shapes(n: int) -> list[tuple[int, ...]]:
    return [(n,)]


def w4a8_marker(group_size: int = GROUP, convrot_groupsize: int = 256) -> dict:
    """The canonical per-layer marker object (key order matters for the written bytes); here,
    torch-free, so planning a W4A8 conversion does not import torch."""
    return {"format": NAME, "group_size": group_size, "convrot_groupsize": convrot_groupsize}


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class W4A8Reading(ReadingFacet):
    """asym_w4a8_int8: how a layer reads (its description)."""

    def describe(self, fields):
        f = fields or {}
        return f"{NAME} G={f.get('group_size', GROUP)} g={f.get('convrot_groupsize', 256)}"

    def header_nk(self, layer):
        """K from the s_rel grid when it is readable (it tells a 6-bit variant apart)."""
        n, cols = layer.weight.shape
        s_rel = layer.tensors.get("weight_s_rel")
        g = layer.fields.get("group_size")
        if s_rel is not None and len(s_rel.shape) == 2 and isinstance(g, int) and g > 0:
            return n, s_rel.shape[1] * g
        return n, 2 * cols


class W4A8Planning(PlanningFacet):
    """asym_w4a8_int8: what convert plans for it."""

    def marker(self, target, group_size):
        return w4a8_marker(group_size=GROUP, convrot_groupsize=group_size)

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


class W4A8Rules(RulesFacet):
    """asym_w4a8_int8: its header rules."""

    def tensor_violations(self, n, cols, fields, tensors):
        fmt, k, out = self.spec.name, 2 * cols, []
        gs = fields.get("group_size", GROUP)
        if not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0 or k % gs:
            out.append(Violation("Q104", f"group_size {gs!r} does not divide K={k}"))
            gs = None
        for suffix in ("weight_s_rel", "weight_s_channel"):
            if suffix not in tensors:
                out.append(Violation("Q101", f"{fmt} layer has no {suffix}", suffix))
        r = tensors.get("weight_s_rel")
        if r is not None and gs and (r.dtype not in S_REL_DTYPES or shape_of(r) != (n, k // gs)):
            out.append(Violation("Q103", f"weight_s_rel is {r.dtype} {list(shape_of(r))}, "
                                 f"expected F8_E4M3 [{n}, {k // gs}]", "weight_s_rel"))
        sc = tensors.get("weight_s_channel")
        if sc is not None and sc.dtype not in SCALE_DTYPES:
            out.append(Violation("Q102", f"weight_s_channel is {sc.dtype}, expected F32",
                                 "weight_s_channel"))
        if sc is not None and shape_of(sc) not in w4a8_channel_shapes(n):
            out.append(Violation("Q103", f"weight_s_channel is {list(shape_of(sc))}, expected "
                                 f"[{n}]", "weight_s_channel"))
        cb = tensors.get("weight_codebook")
        if cb is not None and (cb.dtype not in SCALE_DTYPES or shape_of(cb) != (16,)):
            out.append(Violation("Q103", f"weight_codebook is {cb.dtype} {list(shape_of(cb))}, "
                                 "expected F32 [16]", "weight_codebook"))
        if k % 16:
            out.append(Violation("Q108", f"K={k} is not a multiple of 16"))
        return n, k, out

    def combination_violations(self, fields, tensors):
        if fields.get("convrot") is False:
            return [Violation("M114", "asym_w4a8_int8 always uses ConvRot; the marker says "
                              "convrot=false")]
        return []

    def skip_shape(self, suffix, layer):
        """The weight's width and s_rel's columns are judged by ``header_findings``."""
        g = layer.fields.get("group_size")
        if not isinstance(g, int) or g <= 0:
            return suffix == "weight_s_rel"
        return suffix == "weight"

    def header_findings(self, layer, n, k, add):
        """Packed width vs the K implied by the s_rel grid (4-bit: K/2 bytes; 6-bit: 3K/4)."""
        w = layer.weight
        if n is None or k is None or len(w.shape) != 2 or w.dtype not in ("I8", "U8"):
            return
        cols = w.shape[1]
        if 2 * cols == k:
            return
        g = layer.fields.get("group_size")
        s_rel = layer.tensors.get("weight_s_rel")
        src = (f"weight_s_rel {_fmt_shape(s_rel.shape)} x group_size {g}"
               if s_rel is not None and len(s_rel.shape) == 2 else "the packed width")
        if 4 * cols == 3 * k:
            add("Q105", f"packed width {cols} = 3K/4 for K={k} ({src}): the 6-bit W4A8 variant, "
                "which h3quant cannot convert or run (expected [N, K/2])")
        else:
            add("Q103", f"is {_fmt_shape(w.shape)}: packed width {cols} does not match K={k} "
                f"from {src}; expected I8 [N, K/2] = {_fmt_shape((n, k // 2))} (two 4-bit codes "
                "per byte)")

    def extra_findings(self, layer, add):
        if "weight_correction" in layer.tensors:
            add("Q107", "asymmetric correction tensor present; ComfyUI does not load it, so the "
                "layer runs as the symmetric variant (expected no weight_correction)",
                "weight_correction")

    def constraints(self, layer, k, add):
        g = layer.fields.get("group_size", 16)
        if not isinstance(g, int) or g < 4 or (16 % g and g % 16):
            add("Q108", f"group_size {g!r} is illegal: it must be >= 4 and divide 16 or be a "
                "multiple of 16")
        else:
            bad = [d for d in (16, g) if k % d]
            if bad:
                divisors = " and ".join(map(str, sorted(set(bad))))
                add("Q108", f"K={k} is not divisible by {divisors}; "
                    f"W4A8 needs K % 16 == 0 and K % group_size ({g}) == 0")


SPEC = FormatSpec(
    name=NAME,
    description="4-bit codes (two per byte) + e4m3 group scales + fp32 row scales, ConvRot always on",
    storage=StorageFacet(
        tensors=(
            TensorSpec("weight", ("I8",), lambda n, k, f: [(n, k // 2)], "[N, K/2]"),
            TensorSpec("weight_s_rel", S_REL_DTYPES,
                       lambda n, k, f: [(n, k // f["group_size"])], "[N, K/G]"),
            TensorSpec("weight_s_channel", SCALE_DTYPES,
                       lambda n, k, f: w4a8_channel_shapes(n), "[N]"),
            TensorSpec("weight_codebook", ("F32",), lambda n, k, f: [(16,)], "[16]", required=False),
            TensorSpec("weight_correction", FLOATS, None, "[K/G, N]", required=False),
            BIAS,
        ),
        marker_defaults={"group_size": GROUP, "convrot_groupsize": 256, "convrot": True},
        always_convrot=True,
        convrot_rules=True,
        packed=True,
    ),
    encoding=EncodingFacet(
        targets=(Target("w4a8", NAME, True, "4-bit weights with e4m3 group scales (ConvRot)"),),
        chunked=False,  # the codebook is chosen per layer
        unrowed_outputs=("weight_codebook",),
        calibrates=True,
    ),
    relayout=RelayoutFacet(
        grid_rows=("weight", "weight_s_rel"),
        grid_whole=("weight_codebook",),
        grid_scale="weight_s_channel",
        grid_note="the decoded W4A8 int8 grid the runtime multiplies (codes w8, scale s_channel)",
    ),
    runtime=RuntimeFacet(
        kitchen=KitchenFacts("AsymW4A8Int8Layout", (8, 0), "0.2.27",
                             "ComfyUI v0.31.0, reported"),
        tensors=("weight", "weight_s_rel", "weight_s_channel", "weight_codebook"),
        required=("weight", "weight_s_rel", "weight_s_channel"),
    ),
    verify=VerifyFacet(
        limits=VerifyLimits(rel_err=0.12, block_sqnr_db=8.0),
        deep_scales=("weight_s_rel", "weight_s_channel"),
        deep_whole=("weight_codebook",),
        weight_bits=4,
    ),
    reading=W4A8Reading(),
    planning=W4A8Planning(),
    rules=W4A8Rules(),
)
