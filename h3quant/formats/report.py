"""A layer's header-only summary for ``inspect``: format, logical [N, K], bytes, bits per weight."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from h3quant.formats import registry
from h3quant.formats.check import logical_shape


@dataclass
class LayerReport:
    name: str
    format: str  # wire format name, or the weight dtype for a float layer
    N: int | None
    K: int | None
    dtypes: dict[str, str]
    nbytes: int  # every tensor but the marker
    bits_per_weight: float | None
    source: str | None = None  # where the marker came from
    quantized: bool = False
    params: int = 0  # logical weight elements (N*K, or the weight's numel)
    weight_bytes: int = 0  # bytes counted in bits_per_weight
    layout: str | None = None  # quantized: "canonical" or "npu" (int8_tensorwise_kn, [K, N])
    nz: bool | None = None  # npu layout: FRACTAL_NZ-eligible (K % 16 == 0 and N % 32 == 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("quantized", "params", "weight_bytes"):
            d.pop(k)
        d["bytes"] = d.pop("nbytes")
        d["layout"], d["nz"] = d.pop("layout"), d.pop("nz")  # last, after bytes
        return d


def layer_report(layer) -> LayerReport:
    """Header-only summary: bpw = 8 * bytes of weight and scales (not bias/marker) / (N*K)."""
    n, k = logical_shape(layer)
    w = layer.weight
    quantized = layer.fields is not None
    if quantized:
        fmt = layer.fields["format"]
    else:
        fmt = w.dtype if w is not None else "?"
    if n is not None and k is not None:
        params = n * k
    else:
        params = w.numel if w is not None else 0
    wbytes = sum(t.nbytes for s, t in layer.tensors.items() if s not in ("bias", "comfy_quant"))
    bpw = round(8 * wbytes / params, 4) if params else None
    nz = None
    codec = registry.get(fmt) if quantized else None
    if codec is not None and n is not None and k is not None:
        nz = codec.grid.nz_eligible(n, k)
    return LayerReport(
        name=layer.name, format=fmt, N=n, K=k,
        dtypes={s: t.dtype for s, t in sorted(layer.tensors.items())},
        nbytes=layer.nbytes, bits_per_weight=bpw, source=layer.source,
        quantized=quantized, params=params, weight_bytes=wbytes,
        layout=_layout(fmt) if quantized else None,
        nz=nz,
    )


def _layout(fmt: str) -> str:
    spec = registry.spec(fmt)
    return spec.layout if spec is not None else "canonical"
