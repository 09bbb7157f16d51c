"""Text rendering of pipeline results for the terminal (the pipelines return data only)."""

from __future__ import annotations

from h3quant.sizes import size_text
from h3quant.pipelines.convert.options import REPORT_ROWS


def render_plan(d: dict) -> str:
    """Human-readable convert plan (``ConvertPlan.to_dict()``) or finished report
    (``ConvertReport.to_dict()``): layers by action, copies, repairs, output size."""
    lines = [f"convert {d['input']} -> {d['output']}",
             f"target {d['target']} (group size {d['group_size']})"
             + (f", layout {d['layout']}" if d.get("layout", "canonical") != "canonical" else "")
             + f", preset {d['preset']}"
             + (" (H3 detected)" if d["h3"] else "")]
    naming = d.get("naming")
    if naming:
        lines.append(f"input naming {naming['naming']} ({naming['evidence']}): read as "
                     "ComfyUI's single file")
        for t in naming["targets"]:
            ops = [] if t["op"] == "copy" else [t["op"]]
            ops += ["fp8 decoded"] if t["fp8"] else []
            if ops or t["sources"] != [t["name"]]:
                lines.append(f"  {' + '.join(t['sources'])} -> {t['name']}"
                             + (f"  [{', '.join(ops)}]" if ops else ""))
        for name in naming["unused"]:
            lines.append(f"  not used by ComfyUI, not written: {name}")
    lora = d.get("lora")
    if lora:
        files = ", ".join(f"{f['file']} x {f['strength']:g}" for f in lora["files"])
        lines.append(f"LoRA baked in float before encoding ({files}): {len(lora['layers'])} "
                     "layer(s)")
        lines += [f"  {name}" for name in lora["layers"]]
        lines += [f"  skipped: {s}" for s in lora["skipped"]]
    by: dict[str, list[dict]] = {}
    for lay in d["layers"]:
        by.setdefault(lay["action"], []).append(lay)
    titles = {"convert": "convert", "keep": "already in the target format (re-emitted)",
              "skip": "skipped", "untouched": "quantized, not selected (copied)"}
    for action, title in titles.items():
        rows = by.get(action, [])
        if not rows:
            continue
        lines.append(f"{title}: {len(rows)} layer(s)")
        for lay in rows:
            extra = f"  [{lay['reason']}]" if lay.get("reason") else ""
            err = f"  FAILED: {lay['error']}" if lay.get("error") else ""
            m = lay.get("metrics")
            met = (f"  rel {m['weight_rel_l2']:.4f} sqnr {m['sqnr_db']:.1f} dB "
                   f"out {m['output_rel_l2']:.4f}") if m else ""
            lines.append(f"  {lay['name']} {lay['shape']}: {lay['from']} -> {lay['to']}"
                         f"{extra}{met}{err}")
            for note in lay.get("notes", ()):
                lines.append(f"      note: {note}")
    c = d["copied"]
    lines.append(f"copied byte for byte: {c['tensors']} tensor(s), {size_text(c['bytes'])}")
    if d["dropped"]:
        lines.append(f"not written (replaced or dropped): {len(d['dropped'])} tensor(s)")
    for r in d["repairs"]:
        lines.append(f"repair: {r}")
    for w in d.get("warnings", ()):
        lines.append(f"warning: {w}")
    if d.get("identity"):
        lines.append("nothing to convert: the output re-emits the input unchanged")
    files = d["files"]
    where = f" in {len(files)} files" if len(files) > 1 else ""
    lines.append(f"output size: {d['output_bytes']:,} bytes ({size_text(d['output_bytes'])}){where}; "
                 f"input {size_text(d['input_bytes'])}")
    return "\n".join(lines)


def render_mix(mix: list[dict]) -> str:
    """The per-layer mix of formats (``InspectResult.mix``): one line per run of blocks whose
    linears share their formats, then the other linears."""
    lines = ["per-layer formats (a mixed file):"]
    for row in mix:
        if "blocks" in row:
            by: dict[str, list[str]] = {}
            for local, fmt in row["layers"].items():
                by.setdefault(fmt, []).append(local)
            parts = "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in by.items())
            lines.append(f"  blocks {row['blocks']:<8} {parts}")
        else:
            lines.append(f"  {row['layer']}: {row['format']}")
    return "\n".join(lines)


def summary_line(summary: dict, converted: int = 0) -> str:
    """One line of the convert error report's summary (``ConvertReport.summary``);
    ``converted``: the layers the run converted (some may only move bytes, bit for bit)."""
    if not summary.get("layers"):
        if converted:
            return (f"error report: nothing to measure: the {converted} converted layer(s) "
                    "were re-laid out bit for bit, not re-encoded")
        return "error report: no converted layers"
    return (f"error report ({summary['layers']} layers, up to {REPORT_ROWS} rows each): "
            f"weight rel L2 mean {summary['mean_weight_rel_l2']:.4f} "
            f"max {summary['max_weight_rel_l2']:.4f}; "
            f"output rel L2 mean {summary['mean_output_rel_l2']:.4f} max "
            f"{summary['max_output_rel_l2']:.4f} (seeded random inputs); mean weight SQNR "
            f"{summary['mean_sqnr_db']:.1f} dB; worst layer {summary['worst_layer']}"
            + _calibrated_part(summary))


def _calibrated_part(summary: dict) -> str:
    """The output SQNR over the calibration statistics (and held-out ones): what calibrated
    codes improve, while their weight error and random-input error may grow."""
    cal = summary.get("mean_output_sqnr_db_calibration")
    if cal is None:
        return ""
    text = (f"; output SQNR on the calibration statistics mean {cal:.1f} dB over "
            f"{summary['output_sqnr_layers_calibration']} calibrated layers")
    held = summary.get("mean_output_sqnr_db_heldout")
    if held is not None:
        text += f", on the held-out statistics {held:.1f} dB"
    return text + " (calibration is judged by these, not by the weight or random-input error)"
