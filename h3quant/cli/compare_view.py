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


def headers(res) -> list[str]:
    return ["rank", "file", "formats", "MB", "bits/w", "video dB", "audio dB", "limit dB",
            "final v dB", "final a dB", "PSNR v dB", speed_header(res), "worst block",
            "verdict"]


def speed_header(res) -> str:
    """The speed column names the device it was measured on; a CPU's time says nothing of a
    GPU's."""
    dev = res.run["device"]
    return f"s/step ({dev}{', not GPU speed' if dev.startswith('cpu') else ''})"


def _rank(c) -> str:
    if c.failures:
        return f"{c.rank} FAIL" if c.rank else "FAIL"
    return f"={c.rank}" if c.tie else str(c.rank)


def _verdict(c) -> str:
    if c.role == "reference":
        return "-"
    if c.failures:
        return "FAILED"
    if c.flags:
        return "FLAGGED"
    return "ok" if c.expected is not None else "ok (limits)"


def rows(res) -> list[list]:
    out = []
    for c in [res.reference] + res.ranked():
        ref = c.role == "reference"
        fv, fa = c.final.get("video"), c.final.get("audio")
        ov, oa = c.outputs.get("video"), c.outputs.get("audio")
        lim = c.limiting_stream
        out.append([
            "ref" if ref else _rank(c),
            os.path.basename(c.facts.path), c.facts.label, mb_number(c.facts.size_bytes),
            "-" if c.facts.bits_per_weight is None else f"{c.facts.bits_per_weight:.2f}",
            "-" if ref or ov is None else _db(ov.sqnr_db),
            "-" if ref or oa is None else _db(oa.sqnr_db),
            "-" if ref or lim is None else f"{lim} {_db(c.quality_db)}",
            _db(fv.sqnr_db) if fv else "-", _db(fa.sqnr_db) if fa else "-",
            _db(fv.psnr_db) if fv else "-", _s(c.step_seconds),
            "-" if ref else c.suspect_block, _verdict(c),
        ])
    return out


def floor_line(res) -> str | None:
    f = res.floor
    if not f:
        return None
    return (f"noise floor (the reference against itself: {'; '.join(f['how'])}): video "
            f"{_db(f['video'])} dB, audio {_db(f['audio'])} dB; differences it can explain are "
            "ties (=)")


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
    lines.append(format_table(headers(res), rows(res),
                              right={0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}))
    lines += ["", LEGEND]
    fl = floor_line(res)
    if fl:
        lines.append(fl)
    for c in res.ranked():
        if c.expected is not None:
            lines.append(f"expected: {os.path.basename(c.facts.path)}: {c.expected['what']}: "
                         + ", ".join(f"{k} {_db(v)} dB" for k, v in c.expected["outputs"].items()))
        for n in c.flags:
            lines.append(f"FLAGGED: {os.path.basename(c.facts.path)}: {n}")
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


LEGEND = ("video / audio dB: SQNR of one forward's outputs (higher is better); limit dB: the "
          "worse of the two, which the files are ranked by; final v / a dB: SQNR of the final "
          "latents after the sampling run; worst block: the block whose update alone is least "
          "accurate; verdict: against a fresh plain encode of the reference in the file's own "
          "formats (ok, FLAGGED) or, where none can be made, the fixed limits. Files without a "
          "flag rank first (no VAE, no perceptual metric: docs/compare.md).")


def _markdown_table(headers: list[str], body: list[list]) -> list[str]:
    def cell(x) -> str:
        return str(x).replace("|", "\\|")

    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(cell(x) for x in r) + " |" for r in body])


def markdown(res) -> str:
    out = _markdown_table(headers(res), rows(res))
    pre = [f"- {line}" for line in _preamble(res)]
    front: list[str] = []
    if res.frontier:
        front = ["", "#### Planner frontier (predicted)", "",
                 *_markdown_table(FRONTIER_HEADERS, frontier_rows(res)),
                 "", FRONTIER_NOTE[0].upper() + FRONTIER_NOTE[1:] + "."]
    return "\n".join(["### h3quant compare", ""] + pre + [""] + out + [
        "", LEGEND, *([floor_line(res) or ""] if res.floor else []),
        *[f"- FLAGGED: {os.path.basename(c.facts.path)}: {n}" for c in res.ranked()
          for n in c.flags],
        "", "SQNR / PSNR against the reference's latents on the same inputs and noise; no VAE "
            "decode and no perceptual metric. Made with `h3quant compare` (docs/compare.md).",
        *front, ""])


def plot_png(res) -> bytes:
    """Three panels: size against quality (both streams), the per-block drift, the per-step
    drift. Files are numbered by rank (the legend names them), so no label overprints
    another; the axes fit the data; every SQNR axis says higher is better."""
    import io

    from h3quant.cli.verify_view import require_matplotlib

    plt = require_matplotlib()
    cards = res.ranked()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    # one colour and marker per file in every panel (10 colours, then other markers)
    cmap = plt.get_cmap("tab10")
    style = {id(c): (cmap(i % 10), "osD^v"[i // 10 % 5]) for i, c in enumerate(cards)}
    names = {id(c): f"{_rank(c)} {os.path.basename(c.facts.path)}"
             + (" (FLAGGED)" if c.flags else "") for c in cards}
    ax = axes[0]
    xs: list[float] = []
    ys: list[float] = []
    for c in cards:
        pts = [(k, m.sqnr_db) for k, m in sorted(c.outputs.items()) if math.isfinite(m.sqnr_db)]
        if not pts:
            continue
        x = c.facts.size_bytes / MB
        colour, marker = style[id(c)]
        vals = [v for _, v in pts]
        ax.plot([x, x], [min(vals), max(vals)], color=colour, linewidth=1)
        for k, v in pts:
            ax.scatter([x], [v], color=colour if k == "video" else "white", edgecolors=[colour],
                       marker=marker, s=36, zorder=3)
        ax.annotate(_rank(c), (x, min(vals)), fontsize=8, xytext=(0, -11),
                    textcoords="offset points", ha="center", color=colour)
        xs.append(x)
        ys += vals
    if res.frontier:
        _draw_frontier(ax, res)
        for p in res.frontier:
            y = p["predicted_min_sqnr_db"]
            if y is not None and math.isfinite(y):
                xs.append(p["predicted_bytes"] / MB)
                ys.append(y)
    _fit(ax, xs, ys)
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("one-forward output SQNR (dB), higher is better")
    ax.set_title("size against quality: video filled, audio hollow")
    for c in cards:  # the legend maps each number to its file
        ax.scatter([], [], color=style[id(c)][0], marker=style[id(c)][1], label=names[id(c)])
    ax.legend(fontsize=7, loc="best")
    ax = axes[1]
    for c in cards:
        ax.plot([d.block for d in c.drift], [_finite(d.sqnr_db) for d in c.drift],
                color=style[id(c)][0], marker=style[id(c)][1], markersize=3, label=names[id(c)])
    ax.set_xlabel("block")
    ax.set_ylabel("hidden-state SQNR (dB), higher is better")
    ax.set_title("drift per block (one forward)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax = axes[2]
    for c in cards:
        if c.steps:
            steps = [s.step + 1 for s in c.steps]
            ax.plot(steps, [_finite(s.video_sqnr_db) for s in c.steps], color=style[id(c)][0],
                    marker=style[id(c)][1], markersize=3, label=names[id(c)])
            ax.plot(steps, [_finite(s.audio_sqnr_db) for s in c.steps], color=style[id(c)][0],
                    marker=style[id(c)][1], markersize=3, linestyle="--", fillstyle="none")
    ax.set_xlabel("sampler step")
    ax.set_ylabel("latent SQNR (dB), higher is better")
    ax.set_title("drift per sampler step: video solid, audio dashed")
    ax.xaxis.get_major_locator().set_params(integer=True)
    for a in axes:
        a.grid(True, alpha=0.3)
    fig.suptitle(f"h3quant compare on {res.run['device']} (reference: "
                 f"{os.path.basename(res.reference.facts.path)}); numbers are ranks",
                 fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=100, format="png")
    finally:
        plt.close(fig)
    return buf.getvalue()


def _fit(ax, xs: list[float], ys: list[float]) -> None:
    """Axes that fit the points drawn, with a small margin."""
    for data, setter, least in ((xs, ax.set_xlim, 0.03), (ys, ax.set_ylim, None)):
        if not data:
            continue
        lo, hi = min(data), max(data)
        pad = max((hi - lo) * 0.08, abs(hi) * least if least else 0.5)
        setter(lo - pad, hi + pad)
    ax.ticklabel_format(useOffset=False)


def _draw_frontier(ax, res) -> None:
    """The planner's predicted frontier (one forward's output SQNR, the worse output) as a
    stepped line."""
    pts = [(p["predicted_bytes"] / MB, p["predicted_min_sqnr_db"]) for p in res.frontier
           if p["predicted_min_sqnr_db"] is not None
           and math.isfinite(p["predicted_min_sqnr_db"])]
    if pts:
        ax.plot([x for x, _ in pts], [y for _, y in pts], color="black", linestyle="--",
                marker="+", drawstyle="steps-post", linewidth=1,
                label="planner frontier (predicted one-forward SQNR, the worse output)")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
