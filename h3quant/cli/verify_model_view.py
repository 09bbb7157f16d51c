"""Rendering of ``verify --model``: the text report and the ``--plot`` drift chart."""

from __future__ import annotations

import os

from h3quant.cli.common import format_table
from h3quant.errors import H3QuantError


def _f(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}" if x == x else "nan"


def render(res) -> str:
    i = res.inputs
    out = [f"checkpoint  {res.path}", f"reference   {res.reference}",
           f"device      {res.device}   formats {', '.join(res.formats)}   backends "
           + ", ".join(f"{k} x{v}" for k, v in sorted(res.backends.items())),
           f"inputs      video [1, C, {i.frames}, {i.height}, {i.width}]  audio [1, C, 2, "
           f"{i.audio_frames}]  text [1, {i.text_tokens}, D]  sigma {i.sigma:g}  seed {i.seed}",
           f"depth       {res.depth} of {res.blocks_total} blocks"
           + ("" if res.final_layer_run else "  (final layer skipped)"), ""]
    rows = [[o.name, f"{o.sqnr_db:.2f}", _f(o.rel_err), f"{o.cosine:.6f}", f">= {o.limit_db:g} dB",
             "ok" if o.passed else "FAIL"] for o in res.outputs]
    out.append(format_table(["output", "SQNR dB", "rel err", "cosine", "limit", ""], rows,
                            {1, 2, 3}))
    out.append("")
    rows = [[d.block, f"{d.sqnr_db:.2f}", _f(d.rel_err), f"{d.cosine:.6f}"] for d in res.drift]
    out.append("drift: SQNR of the hidden state after each block")
    out.append(format_table(["block", "SQNR dB", "rel err", "cosine"], rows, {0, 1, 2, 3}))
    for note in res.notes:
        out.append(f"note: {note}")
    out.append("")
    out.append("PASS" if res.passed else f"FAIL ({len(res.failures)} checks failed)")
    return "\n".join(out)


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


def plot(res, path: str) -> None:
    """Drift (hidden-state SQNR) against depth, with the threshold line, to a PNG file."""
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
    tmp = f"{path}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)  # never a partial PNG at ``path``
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
