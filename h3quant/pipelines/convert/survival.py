"""How much of a baked LoRA survives encoding, per layer.

For each layer a LoRA touches, with ``W`` the base weight, ``d`` the LoRA's delta (float64, as
the files and strengths give it) and ``Q`` the layer's target encoding (decoded back to fp32):

- ``change_ratio = ||Q(W + d) - Q(W)|| / ||d||``: how large the encoded change is next to the
  delta. It can exceed 1: where the delta is small next to the grid step, the codes that flip
  add rounding noise that has nothing to do with the delta;
- ``kept = <Q(W + d) - Q(W), d> / ||d||^2``: the share of the delta the output carries along
  the delta's own direction (1.0: all of it; near 0: rounding ate it; at 4 bits small deltas
  vanish). This is the figure the warning uses;
- ``codes_changed``: the fraction of the layer's stored codes that differ from encoding ``W``.

A layer that keeps less than ``ConvertOptions.lora_warn`` is warned about, with the remedy: write
it int8 (or bf16), whose finer grid keeps small deltas.
"""

from __future__ import annotations


def summary(loras) -> dict:
    """What the plan says about the LoRAs: files, strengths and the layers each touches."""
    return {"files": [{"file": p, "strength": s} for p, s in loras.files],
            "layers": sorted(loras.layers), "skipped": list(loras.skipped)}


def _decoded(codec, marker, w, method):
    out = codec.encode(w, marker, method)
    deq, grid = codec.report_grid(out, marker)
    codes = grid[0] if grid is not None else out["weight"]
    return deq.to(dtype=_f64()), codes


def _f64():
    import torch

    return torch.float64


def measure(view, loras, plan, options, log) -> dict:
    """The survival of every LoRA layer of ``view`` (a ``SourceView`` with ``loras``)."""
    import torch

    by_layer = {lp.name: lp for lp in plan.layers}
    rows = []
    warnings = []
    for layer in sorted(loras.layers):
        merged = view.read(layer + ".weight")
        base = view.base(layer + ".weight")
        n, k = merged.shape
        delta = loras.delta_rows(layer, 0, n, k)
        d_norm = float(delta.norm())
        lp = by_layer.get(layer)
        if lp is None or not options.report:  # stored as it is (a float layer kept float)
            fmt = str(merged.dtype).replace("torch.", "")
            diff = merged.to(torch.float64) - base.to(torch.float64)
            changed = float((merged != base).float().mean())
        else:
            codec = getattr(lp, "codec", None) or options.codec
            fmt = codec.describe(lp.out_fields)
            qm, cm = _decoded(codec, lp.out_fields, merged, options.rotation)
            qb, cb = _decoded(codec, lp.out_fields, base, options.rotation)
            diff = qm - qb
            changed = float((cm != cb).float().mean())
            del qm, qb, cm, cb
        ratio = float(diff.norm()) / d_norm if d_norm > 0 else 1.0
        kept = float((diff * delta).sum()) / d_norm ** 2 if d_norm > 0 else 1.0
        del diff, merged, base, delta
        row = {"layer": layer, "format": fmt, "delta_norm": round(d_norm, 6),
               "kept": round(kept, 4), "change_ratio": round(ratio, 4),
               "codes_changed": round(changed, 4)}
        rows.append(row)
        if lp is not None and options.report and kept < options.lora_warn:
            warnings.append(f"{layer}: only {kept:.0%} of the LoRA delta survives {fmt} "
                            f"({changed:.1%} of codes changed); int8-convrot (or bf16, "
                            f"with --exclude) keeps it")
    for w in warnings:
        log(f"warning: {w}")
    return {**summary(loras), "survival": rows, "warnings": warnings}
