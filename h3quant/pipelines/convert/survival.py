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


ROWS = 1024  # rows compared at once (float64)


def _rows(x, r0: int, r1: int):
    import torch

    return x[r0:r1].to(torch.float64)


def _encoded(codec, marker, w, method):
    """(decoded fp32 weight, stored codes) of ``w`` in the target format."""
    out = codec.encoder.encode(w, marker, method)
    deq, grid = codec.encoder.report_grid(out, marker)
    return deq, (grid[0] if grid is not None else out["weight"])


def _compare(loras, layer: str, pairs) -> tuple[float, float, float]:
    """(||d||, <dq, d>, ||dq||) summed over row chunks; ``pairs`` yields (r0, r1, dq rows)."""
    norm = dot = change = 0.0
    for r0, r1, dq in pairs:
        d = loras.delta_rows(layer, r0, r1, dq.shape[1])
        norm += float(d.square().sum())
        dot += float((dq * d).sum())
        change += float(dq.square().sum())
    return norm ** 0.5, dot, change ** 0.5


def _layer(view, loras, layer: str, lp, options) -> dict:
    """One layer's survival figures, in bounded memory: a row-chunked target (int8, bf16) is
    encoded ``ROWS`` rows at a time over every row; a whole-layer one (W4A8: its codebook is
    chosen per layer) is encoded whole, once merged and once not, one after the other, and
    compared on the error report's evenly spaced rows (``rows`` says how many).
    ``delta_norm`` is over the same rows."""
    import torch

    wname = layer + ".weight"
    merged, base = view.read(wname), view.base(wname)
    n = merged.shape[0]
    numel = merged.numel()
    sampled = n
    spans = [(r0, min(n, r0 + ROWS)) for r0 in range(0, n, ROWS)]
    if lp is None:  # kept as it is stored (a float layer outside the converted set)
        fmt = str(merged.dtype).replace("torch.", "")
        changed = sum(int((merged[a:b] != base[a:b]).sum()) for a, b in spans)
        pairs = ((a, b, _rows(merged, a, b) - _rows(base, a, b)) for a, b in spans)
    else:
        lopts = lp.options or options  # a --layer / --recipe rule's target, else --to
        codec = lopts.codec
        fmt = codec.spec.reading.describe(lp.out_fields)
        if codec.spec.encoding.chunked:
            changed = 0

            def gen():
                nonlocal changed
                for a, b in spans:
                    qm, cm = _encoded(codec, lp.out_fields, merged[a:b], lopts.rotation)
                    qb, cb = _encoded(codec, lp.out_fields, base[a:b], lopts.rotation)
                    changed += int((cm != cb).sum())
                    yield a, b, qm.to(torch.float64) - qb.to(torch.float64)
            pairs = gen()
        else:  # whole-layer codec: encoded whole, compared on the report's sampled rows
            from h3quant.pipelines.convert.compute import sample_rows

            idx = sample_rows(n)
            qm, cm = _encoded(codec, lp.out_fields, merged, lopts.rotation)
            qm, cm = qm[idx].to(torch.float64), cm[idx].clone()
            del merged
            qb, cb = _encoded(codec, lp.out_fields, base, lopts.rotation)
            qb, cb = qb[idx].to(torch.float64), cb[idx].clone()
            changed, codes = int((cm != cb).sum()), cm.numel()
            pairs = ((int(r), int(r) + 1, (qm[i] - qb[i])[None]) for i, r in enumerate(idx))
            sampled = len(idx)
    d_norm, dot, change = _compare(loras, layer, pairs)
    total = numel if sampled == n else codes
    ratio = change / d_norm if d_norm > 0 else 1.0
    kept = dot / d_norm ** 2 if d_norm > 0 else 1.0
    return {"layer": layer, "format": fmt, "delta_norm": round(d_norm, 6),
            "kept": round(kept, 4), "change_ratio": round(ratio, 4),
            "codes_changed": round(changed / max(total, 1), 4), "rows": sampled}


def measure(view, loras, plan, options, log, progress: bool = False) -> dict:
    """The survival of every LoRA layer of ``view`` (a ``SourceView`` with ``loras``); only the
    summary without ``options.report``."""
    if not options.report:
        return summary(loras)
    by_layer = {lp.name: lp for lp in plan.layers if lp.action == "convert"}
    rows, warnings = [], []
    layers = sorted(loras.layers)
    bar = None
    if progress and layers:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(layers), unit="layer", desc="LoRA survival", file=sys.stderr,
                   leave=False)
    for layer in layers:
        if bar is not None:
            bar.update(1)
        lp = by_layer.get(layer)
        row = _layer(view, loras, layer, lp, options)
        rows.append(row)
        if lp is not None and row["kept"] < options.lora_warn:
            warnings.append(f"{layer}: only {row['kept']:.0%} of the LoRA delta survives "
                            f"{row['format']} ({row['codes_changed']:.1%} of codes changed); "
                            "--lora-promote int8-convrot writes the layers a LoRA touches int8")
    if bar is not None:
        bar.close()
    if len(warnings) == 1:
        log(f"warning: {warnings[0]}")
    elif warnings:  # one line for all: the layers of one format behave alike
        low = sorted((r for r in rows if r["layer"] in {w.split(":")[0] for w in warnings}),
                     key=lambda r: r["kept"])
        fmts = sorted({r["format"] for r in low})
        log(f"warning: {len(low)} layers keep less than {options.lora_warn:.0%} of the LoRA "
            f"delta after {', '.join(fmts)} encoding (from {low[0]['kept']:.0%} in "
            f"{low[0]['layer']} to {low[-1]['kept']:.0%}; each layer in the report); "
            "--lora-promote int8-convrot writes the layers a LoRA touches int8")
    return {**summary(loras), "survival": rows, "warnings": warnings}
