"""The NPU pre-transposed int8 layout ``int8_tensorwise_kn`` (FORMATS.md section 9).

A kn layer stores exactly the transpose of the canonical int8_tensorwise codes: ``weight I8 [K, N]``
C-contiguous and ``weight_scale F32 [N]``; math, rotation and scales are those of int8_tensorwise.
The format has its own name so that a reader that only knows int8_tensorwise fails loudly instead
of mis-reading the transposed weight (for a square layer no shape check would catch it).

Every relayout (canonical -> kn, kn -> canonical, freshly encoded codes -> kn) goes through the
streamed transposer of ``h3quant.formats.transpose``. No devices, no files:
pure tensor and byte work. Importing this module does not import torch (inspect and validate
read only headers).
"""

from __future__ import annotations

from h3quant.convrot import check_group_size
from h3quant.formats.int8.spec import NAME as CANONICAL  # the math it re-lays out

FORMAT = "int8_tensorwise_kn"
LAYOUTS = ("canonical", "npu")  # convert --layout values
NZ_FORMAT = 29  # ACL_FORMAT_FRACTAL_NZ, the id npu_format_cast takes
NZ_K_MULTIPLE = 16  # int8 FRACTAL_NZ: K % 16 == 0 ...
NZ_N_MULTIPLE = 32  # ... and N % 32 == 0, else the weight stays ND
NPU_MAX_N = 65535  # npu_quant_matmul's limit on N per rank


def kn_marker(convrot: bool = True, group_size: int = 256) -> dict:
    """The canonical kn marker: the int8 one with the format name changed (key order kept)."""
    if not convrot:
        return {"format": FORMAT}
    check_group_size(group_size)
    return {"format": FORMAT, "convrot": True, "convrot_groupsize": int(group_size)}


def nz_eligible(n: int, k: int) -> bool:
    """Whether a ``[K, N]`` int8 weight can be cast to FRACTAL_NZ (FORMATS.md 6)."""
    return k % NZ_K_MULTIPLE == 0 and n % NZ_N_MULTIPLE == 0


def nz_reason(n: int, k: int) -> str | None:
    """Why a ``[K, N]`` int8 weight stays ND (None when NZ-eligible)."""
    bad = []
    if k % NZ_K_MULTIPLE:
        bad.append(f"K={k} % {NZ_K_MULTIPLE} != 0")
    if n % NZ_N_MULTIPLE:
        bad.append(f"N={n} % {NZ_N_MULTIPLE} != 0")
    return " and ".join(bad) or None


MAX_TP_DEGREE = 64


def tp_degree_for(n: int, limit: int = NPU_MAX_N) -> int | None:
    """The smallest tensor-parallel degree (column split of N, at most MAX_TP_DEGREE ranks)
    giving every rank ``<= limit`` outputs in equal whole shards, or None when none fits."""
    if n <= limit:
        return 1
    for d in range(-(-n // limit), MAX_TP_DEGREE + 1):
        if n % d == 0 and n // d <= limit:
            return d
    return None


def check_kn(layer, n: int | None, k: int | None, *, file: str | None = None) -> list:
    """Header-only kn rules of one layer (``n``, ``k`` from its stored ``[K, N]`` weight):
    Q109 scale [N] against the weight, Q110 FRACTAL_NZ eligibility (a note), Q111 N per rank."""
    from h3quant.findings import Finding

    out: list[Finding] = []
    w, s = layer.weight, layer.tensors.get("weight_scale")
    if w is None or n is None or k is None or len(w.shape) != 2:
        return out
    if s is not None and tuple(s.shape) != (n,):
        shape = list(s.shape)
        if s.numel == k and k != n:
            why = (f"it holds K={k} values: the weight looks stored canonical [N, K] under a kn "
                   "marker (or the scale belongs to another layout)")
        elif s.numel == n:
            why = "it holds N values but is not 1-D (npu_quant_matmul takes a 1-D [N] scale)"
        else:
            why = f"it holds {s.numel} values"
        out.append(Finding("Q109", f"weight_scale is {shape} but the weight is I8 [K, N] = "
                           f"[{k}, {n}], so it must be F32 [{n}]; {why}",
                           tensor=layer.tensor_name("weight_scale"), file=file))
    reason = nz_reason(n, k)
    if reason:
        out.append(Finding("Q110", f"{reason}: the NPU keeps this weight ND (no FRACTAL_NZ cast); "
                           "it runs, with less efficient tiling", tensor=layer.tensor_name("weight"),
                           file=file))
    if n > NPU_MAX_N:
        d = tp_degree_for(n)
        fit = (f"tensor parallelism over {d} ranks (N/{d} = {n // d} per rank) would fit" if d
               else "no equal split of N fits")
        out.append(Finding("Q111", f"N={n} outputs exceed npu_quant_matmul's {NPU_MAX_N} per "
                           f"rank; {fit}, else the layer runs dequantized",
                           tensor=layer.tensor_name("weight"), file=file))
    return out


__all__ = [
    "CANONICAL",
    "FORMAT",
    "LAYOUTS",
    "NPU_MAX_N",
    "NZ_FORMAT",
    "check_kn",
    "kn_marker",
    "nz_eligible",
    "nz_reason",
    "tp_degree_for",
]
