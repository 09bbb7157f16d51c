"""``inspect`` and ``validate`` of a GGUF file: the header (version, architecture, metadata),
the tensor types, bits per weight, the H3 topology under ComfyUI's names, and (validate) the
rules: every tensor type dequantizable by the gguf package, the H3 topology, and with ``deep``
every tensor dequantized and checked finite."""

from __future__ import annotations

import os
from types import SimpleNamespace

from h3quant.findings import Finding
from h3quant.formats.gguf.reader import GgufFile


def _views(g: GgufFile) -> dict:
    """The tensors as the topology rules see them (original shapes; float)."""
    return {n: SimpleNamespace(shape=list(t.shape), dtype="F32", numel=t.numel, nbytes=t.nbytes)
            for n, t in g.tensors.items()}


def _dequantizable(qtype: str) -> bool:
    try:
        from gguf.quants import _type_traits  # the package's registry of implemented types
    except ImportError:  # an older or newer package: trust the attempt at read time
        return True
    import gguf

    t = getattr(gguf.GGMLQuantizationType, qtype, None)
    return t is not None and (qtype in ("F32", "F16") or t in _type_traits)


def inspect_gguf(path: str | os.PathLike) -> dict:
    from h3quant.h3 import topology
    from h3quant.h3.topology import is_h3_block_linear

    with GgufFile(path) as g:
        types: dict[str, dict] = {}
        for t in g.tensors.values():
            d = types.setdefault(t.qtype, {"tensors": 0, "bytes": 0})
            d["tensors"] += 1
            d["bytes"] += t.nbytes
        lin = [t for n, t in g.tensors.items()
               if n.endswith(".weight") and is_h3_block_linear(n[:-len(".weight")])]
        params = sum(t.numel for t in g.tensors.values())
        data = sum(t.nbytes for t in g.tensors.values())
        det = topology.detect(_views(g))
        summary = None
        if det is not None:
            summary = topology.summary(det, {n[:-len(".weight")]: "gguf:" + t.qtype
                                             for n, t in g.tensors.items() if t.quantized
                                             and n.endswith(".weight")})
        return {
            "path": str(path), "container": "gguf", "gguf_version": g.version,
            "architecture": g.architecture, "total_bytes": g.total_bytes,
            "tensor_count": len(g.tensors), "parameters": params, "types": types,
            "bits_per_weight": {
                "all": round(8 * data / params, 4) if params else None,
                "block_linears": round(8 * sum(t.nbytes for t in lin)
                                       / sum(t.numel for t in lin), 4) if lin else None},
            "topology": summary, "metadata": g.metadata,
            "naming": "ComfyUI state-dict names" + (
                " behind model.diffusion_model." if any(t.gguf_name != t.name
                                                        for t in g.tensors.values()) else ""),
        }


def validate_gguf(path: str | os.PathLike, *, deep: bool = False) -> tuple[int, list[Finding]]:
    """(tensors checked, findings)."""
    import numpy as np

    from h3quant.errors import H3QuantError
    from h3quant.h3 import topology

    findings: list[Finding] = []
    p = str(path)
    try:
        g = GgufFile(path)
    except H3QuantError as e:
        findings.append(Finding("G101", e.reason, tensor=e.tensor, file=p))
        return 0, findings
    with g:
        for n, t in g.tensors.items():
            if not _dequantizable(t.qtype):
                findings.append(Finding("G102",
                                        f"GGUF type {t.qtype} cannot be dequantized by the "
                                        "gguf package", file=p, tensor=n))
        views = _views(g)
        det = topology.detect(views)
        if det is None:
            findings.append(Finding("G103", "no MiniMax H3 topology under "
                                    "ComfyUI's names", file=p))
        else:
            findings.extend(f for f in topology.check(views, det))
        if deep:
            for n, t in g.tensors.items():
                if not _dequantizable(t.qtype):
                    continue
                a = g.read(n)
                if not np.isfinite(a).all():
                    findings.append(Finding("G104", "non-finite values after "
                                            "dequantization", file=p, tensor=n))
                del a
        return len(g.tensors), findings
