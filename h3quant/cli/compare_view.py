"""The card as text (stdout), markdown (a model card) and a plot (PNG)."""

from __future__ import annotations

import math
import os

from h3quant.cli.common import format_table
from h3quant.sizes import MB, mb_number


def _db(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.1f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


HEADERS = ["rank", "file", "formats", "MB", "bits/w", "video dB", "audio dB", "final v dB",
           "final a dB", "PSNR v dB", "s/step", "worst block"]


def rows(res) -> list[list]:
    out = []
    for c in [res.reference] + res.ranked():
        ref = c.role == "reference"
        fv, fa = c.final.get("video"), c.final.get("audio")
        ov, oa = c.outputs.get("video"), c.outputs.get("audio")
        out.append([
            "ref" if ref else (c.rank if not c.failures else "FAIL"),
            os.path.basename(c.facts.path), c.facts.label, mb_number(c.facts.size_bytes),
            "-" if c.facts.bits_per_weight is None else f"{c.facts.bits_per_weight:.2f}",
            "-" if ref or ov is None else _db(ov.sqnr_db),
            "-" if ref or oa is None else _db(oa.sqnr_db),
            _db(fv.sqnr_db) if fv else "-", _db(fa.sqnr_db) if fa else "-",
            _db(fv.psnr_db) if fv else "-", _s(c.step_seconds),
            "-" if ref else c.suspect_block,
        ])
    return out


FRONTIER_HEADERS = ["point", "formats (blocks)", "MB", "video dB", "audio dB"]
FRONTIER_NOTE = ("planner frontier: predicted by h3quant plan's additive noise model from one "
                 "sensitivity pass over the reference on these inputs (one forward's output "
                 "SQNR; nothing converted), the points no other point beats")


def frontier_rows(res) -> list[list]:
    return [[p["name"], ", ".join(f"{k} {v}" for k, v in sorted(p["formats"].items())),
             mb_number(p["predicted_bytes"]), _db(p["predicted_sqnr_db"]["video"]),
             _db(p["predicted_sqnr_db"]["audio"])] for p in res.frontier or ()]


def _preamble(res) -> list[str]:
    run = res.run
    steps = run["steps"]
    inp = run["inputs"]
    src = f"--inputs {inp['file']}" if inp.get("file") else (
        f"seed {inp['seed']}, {inp['frames']}x{inp['height']}x{inp['width']} video latent, "
        f"{inp['audio_frames']} audio frames, {inp['text_tokens']} text tokens")
    lines = [f"reference: {res.reference.facts.path} ({res.reference.facts.label})"
             + (" - the most precise file given (no --reference)" if res.reference_chosen
                else ""),
             f"inputs: {src}; one forward at sigma {inp['sigma']:g}",
             ("sampling: none" if steps is None else
              f"sampling: {steps} Euler steps, sigmas "
              + ", ".join(f"{s:.4g}" for s in run["schedule"])),
             f"device: {run['device']} ({run['dtype']}); reference on the CPU in float32; "
             f"h3quant {run['h3quant_version']}"]
    return lines


def render(res) -> str:
    lines = _preamble(res) + [""]
    lines.append(format_table(HEADERS, rows(res), right={0, 3, 4, 5, 6, 7, 8, 9, 10, 11}))
    lines += ["", "video / audio dB: SQNR of one forward's outputs; final v / a dB: SQNR of the "
                  "final latents after the sampling run; worst block: the block whose update "
                  "alone is least accurate. Ranked by the lower final SQNR (no VAE, no "
                  "perceptual metric: docs/compare.md)."]
    for c in res.ranked():
        for n in c.notes:
            lines.append(f"note: {os.path.basename(c.facts.path)}: {n}")
    for c in res.failed:
        for n in c.failures:
            lines.append(f"FAILED: {c.facts.path}: {n}")
    lines += [f"note: {n}" for n in res.notes]
    if res.frontier:
        lines += ["", format_table(FRONTIER_HEADERS, frontier_rows(res), right={2, 3, 4}),
                  "", FRONTIER_NOTE + "."]
    return "\n".join(lines)


def _markdown_table(headers: list[str], body: list[list]) -> list[str]:
    def cell(x) -> str:
        return str(x).replace("|", "\\|")

    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(cell(x) for x in r) + " |" for r in body])


def markdown(res) -> str:
    out = _markdown_table(HEADERS, rows(res))
    pre = [f"- {line}" for line in _preamble(res)]
    front: list[str] = []
    if res.frontier:
        front = ["", "#### Planner frontier (predicted)", "",
                 *_markdown_table(FRONTIER_HEADERS, frontier_rows(res)),
                 "", FRONTIER_NOTE[0].upper() + FRONTIER_NOTE[1:] + "."]
    return "\n".join(["### h3quant compare", ""] + pre + [""] + out + [
        "", "SQNR / PSNR against the reference's latents on the same inputs and noise; no VAE "
            "decode and no perceptual metric. Made with `h3quant compare` (docs/compare.md).",
        *front, ""])


def plot_png(res) -> bytes:
    """Three panels: size against quality, the per-block drift, the per-step drift."""
    import io

    from h3quant.cli.verify_view import require_matplotlib

    plt = require_matplotlib()
    cards = res.ranked()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    # one colour and marker per file in every panel (a 20-colour map, markers beyond it)
    cmap = plt.get_cmap("tab20")
    style = {id(c): (cmap(i % 20), "osD^v"[i // 20 % 5]) for i, c in enumerate(cards)}
    ax = axes[0]
    for c in cards:
        q = c.quality_db
        if q is None or not math.isfinite(q):
            continue
        ax.scatter([c.facts.size_bytes / MB], [q], color=style[id(c)][0],
                   marker=style[id(c)][1])
        ax.annotate(os.path.basename(c.facts.path), (c.facts.size_bytes / MB, q),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(res.reference.facts.size_bytes / MB, color="grey", linestyle=":",
               label=f"reference ({os.path.basename(res.reference.facts.path)})")
    if res.frontier:
        _draw_frontier(ax, res, cards, style)
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("quality: final latent SQNR (dB)" if res.run["steps"] else
                  "quality: output SQNR (dB)")
    ax.set_title("size against quality")
    ax.legend(fontsize=7)
    ax = axes[1]
    for c in cards:
        ax.plot([d.block for d in c.drift], [_finite(d.sqnr_db) for d in c.drift],
                color=style[id(c)][0], marker=style[id(c)][1], markersize=3,
                label=os.path.basename(c.facts.path))
    ax.set_xlabel("block")
    ax.set_ylabel("hidden-state SQNR (dB)")
    ax.set_title("drift per block (one forward)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    ax = axes[2]
    for c in cards:
        if c.steps:
            ax.plot([s.step + 1 for s in c.steps], [_finite(s.video_sqnr_db) for s in c.steps],
                    color=style[id(c)][0], marker=style[id(c)][1], markersize=3,
                    label=os.path.basename(c.facts.path))
    ax.set_xlabel("sampler step")
    ax.set_ylabel("video latent SQNR (dB)")
    ax.set_title("drift per sampler step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if any(c.steps for c in cards):
        ax.legend(fontsize=7)
    for a in axes:
        a.grid(True, alpha=0.3)
    fig.suptitle(f"h3quant compare on {res.run['device']} (reference: "
                 f"{os.path.basename(res.reference.facts.path)})", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=100, format="png")
    finally:
        plt.close(fig)
    return buf.getvalue()


def _draw_frontier(ax, res, cards, style) -> None:
    """The planner's predicted frontier (one forward's output SQNR, the worse output) as a
    stepped line; with a sampling run the files' own one-forward output SQNR is drawn too
    (hollow markers), the quantity the frontier predicts."""
    pts = [(p["predicted_bytes"] / MB, p["predicted_min_sqnr_db"]) for p in res.frontier
           if p["predicted_min_sqnr_db"] is not None
           and math.isfinite(p["predicted_min_sqnr_db"])]
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], color="black", linestyle="--",
                marker="+", drawstyle="steps-post", linewidth=1,
                label="planner frontier (predicted one-forward SQNR)")
        for p in res.frontier:
            y = p["predicted_min_sqnr_db"]
            if y is not None and math.isfinite(y):
                ax.annotate(p["name"], (p["predicted_bytes"] / MB, y), fontsize=6,
                            color="dimgrey", xytext=(3, -9), textcoords="offset points")
    if res.run["steps"]:
        ax.set_ylabel("SQNR (dB): final latent (filled), one forward (hollow, frontier)")
        first = True
        for c in cards:
            vals = [m.sqnr_db for m in c.outputs.values()]
            if vals and math.isfinite(min(vals)):
                ax.scatter([c.facts.size_bytes / MB], [min(vals)], facecolors="none",
                           edgecolors=[style[id(c)][0]], marker=style[id(c)][1],
                           label="files: one-forward output SQNR" if first else None)
                first = False


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
