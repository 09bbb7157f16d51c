"""Rendering of every ``verify`` report (per block, ``--model``, ``--tp``) and the ``--plot`` chart.

The three reports share their header lines, number format, notes and verdict footer."""

from __future__ import annotations


from h3quant.cli.common import format_table
from h3quant.sizes import mb_number
from h3quant.errors import H3QuantError


def _f(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}" if x == x else "nan"


def _footer(res) -> list[str]:
    """The notes, then PASS or FAIL with the number of failed checks."""
    out = [f"note: {note}" for note in res.notes]
    out.append("")
    out.append("PASS" if res.passed else f"FAIL ({len(res.failures)} checks failed)")
    return out


def render_blocks(res) -> str:
    out = [f"checkpoint  {res.path}", f"reference   {res.reference}",
           f"device      {res.device}   blocks {res.blocks}   tokens {res.tokens}   "
           f"seed {res.seed}", ""]
    rows = [[c.name + ("" if c.path == "plain" else " [swiglu]"), c.format, c.backend,
             _f(c.rel_err), f"{c.sqnr_db:.2f}", f"{c.cosine:.6f}", f"<= {c.limit:g}",
             "smoothed" if c.smoothed else "ok" if c.passed else "FAIL"] for c in res.layers]
    out.append(format_table(["layer", "format", "backend", "rel err", "SQNR dB", "cosine",
                             "limit", ""], rows, {3, 4, 5}))
    out.append("")
    rows = [[b.index, ",".join(b.formats), f"{b.sqnr_db:.2f}", _f(b.rel_err), f"{b.cosine:.6f}",
             f">= {b.limit_db:g} dB", "ok" if b.passed else "FAIL"] for b in res.block_checks]
    out.append(format_table(["block", "formats", "SQNR dB", "rel err", "cosine", "limit", ""],
                            rows, {2, 3, 4}))
    out.append("")
    failed = [d for d in res.data if not d.passed]
    by_check: dict[str, list] = {}
    for d in res.data:
        by_check.setdefault(d.check, []).append(d)
    for check, items in by_check.items():
        bad = sum(not d.passed for d in items)
        vals = [d.value for d in items if d.value is not None]
        span = f"  values {_f(min(vals))}..{_f(max(vals))}" if vals else ""
        note = next((d.detail for d in items if d.detail and d.passed), "")
        out.append(f"data {check:<11s} {len(items) - bad}/{len(items)} layers ok  "
                   f"({items[0].limit}){span}" + (f"  {note}" if note and not bad else ""))
    for d in failed:
        out.append(f"  FAIL {d.check} {d.name}: {d.detail}")
    return "\n".join(out + _footer(res))


def render_model(res) -> str:
    i = res.inputs
    out = [f"checkpoint  {res.path}", f"reference   {res.reference}",
           f"device      {res.device}   formats {', '.join(res.formats)}   backends "
           + ", ".join(f"{k} x{v}" for k, v in sorted(res.backends.items())),
           f"inputs      video [1, C, {i.frames}, {i.height}, {i.width}]  audio [1, C, 2, "
           f"{i.audio_frames}]  text [1, {i.text_tokens}, D]  sigma {i.sigma:g}  "
           + (f"from {i.file}" if getattr(i, "file", None) else f"seed {i.seed}"),
           f"depth       {res.depth} of {res.blocks_total} blocks"
           + ("" if res.final_layer_run else "  (final layer skipped)")]
    if getattr(res, "head_bank", 1) > 1 or getattr(res, "steps", None):
        out.append(f"schedule    {len(res.steps)} steps, output heads: "
                   + (f"a bank of {res.head_bank}" if res.head_bank > 1 else "one"))
        for st in res.steps:
            heads = st["heads"]
            out.append(f"  step {st['step']:>3}  sigma {st['sigma']:.6f}"
                       + (f"  heads {heads[0]}..{heads[1] - 1}" if heads else ""))
    out.append("")
    rows = [[o.name, f"{o.sqnr_db:.2f}", _f(o.rel_err), f"{o.cosine:.6f}", f">= {o.limit_db:g} dB",
             "ok" if o.passed else "FAIL"] for o in res.outputs]
    out.append(format_table(["output", "SQNR dB", "rel err", "cosine", "limit", ""], rows,
                            {1, 2, 3}))
    out.append("")
    rows = [[d.block, f"{d.sqnr_db:.2f}", _f(d.rel_err), f"{d.cosine:.6f}"] for d in res.drift]
    out.append("drift: SQNR of the hidden state after each block")
    out.append(format_table(["block", "SQNR dB", "rel err", "cosine"], rows, {0, 1, 2, 3}))
    return "\n".join(out + _footer(res))


def require_matplotlib():
    """pyplot on the non-interactive backend, or a clear error (checked before the long run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise H3QuantError("--plot needs matplotlib, which is not installed: pip install "
                           "'h3quant[plot]' (or pip install matplotlib)") from None
    return plt


def plot(res, path: str, *, overwrite: bool = False, inputs=()) -> None:
    """Drift (hidden-state SQNR) against depth, with the threshold line, to a PNG file
    (written through the same output rules and atomic move as every other output)."""
    import io

    from h3quant.formats.container.atomic import write_bytes

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [d.block for d in res.drift]
    ax.plot(xs, [d.sqnr_db for d in res.drift], marker="o", label="hidden state")
    limit = res.outputs[0].limit_db if res.outputs else None
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", label=f"threshold {limit:g} dB")
    for o in res.outputs:
        if o.name in ("video", "audio"):
            ax.scatter([xs[-1]], [o.sqnr_db], marker="s", label=f"{o.name} output")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("block")
    ax.set_ylabel("SQNR vs reference (dB)")
    ax.set_title(f"h3quant verify --model: {', '.join(res.formats)} on {res.device}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=100, format="png")
    finally:
        plt.close(fig)
    write_bytes(path, buf.getvalue(), overwrite=overwrite, inputs=inputs, what="plot")


def render_tp(res) -> str:
    out = [f"checkpoint  {res.path}",
           (f"tensor parallel  tp={res.tp}   scale {res.scale_mode}   device {res.device}   "
            f"backend {res.backend}   launched by {res.launched}"),
           (f"whole forward, blocks {res.blocks}   seed {res.seed}" if any(
               c.parallel == "model" for c in res.checks) else
            f"blocks {res.blocks}   tokens {res.tokens}   seed {res.seed}"), ""]
    rows = [["-" if c.block < 0 else c.block, c.what, c.parallel, c.strategy, c.backend,
             "yes" if c.identical else "no", f"{c.max_abs:.3g}", f"{c.rel_l2:.3g}", c.limit,
             "ok" if c.passed else "FAIL"] for c in res.checks]
    out.append(format_table(["block", "output", "parallel", "split", "backend", "identical",
                             "max |diff|", "rel L2", "limit", ""], rows, {6, 7}))
    out.append("")
    total = max(res.linear_bytes, 1)
    rows = [[r.rank, mb_number(r.bytes_read), f"{r.bytes_read / total:.3f}",
             mb_number(r.bytes_held), mb_number(r.peak_rss)] for r in res.ranks]
    out.append(format_table(["rank", "linears read MB", "share of linears", "held MB (1 block)",
                             "peak RSS MB"], rows, {1, 2, 3, 4}))
    out.append("")
    if res.reference is not None:  # --reference: the single-device verify against it
        out += ["vs the float reference (the same blocks on one device, which the sharded run "
                "matches above):", ""]
        out.append(render_model(res.reference) if hasattr(res.reference, "drift")
                   else render_blocks(res.reference))
        out.append("")
    return "\n".join(out + _footer(res))
