"""Text rendering of the ``verify --tp`` report (rendering only)."""

from __future__ import annotations

from h3quant.cli.common import format_table


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


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
    rows = [[r.rank, _mib(r.bytes_read), f"{r.bytes_read / total:.3f}", _mib(r.bytes_held),
             _mib(r.peak_rss)] for r in res.ranks]
    out.append(format_table(["rank", "linears read MiB", "share of linears", "held MiB (1 block)",
                             "peak RSS MiB"], rows, {1, 2, 3, 4}))
    out.append("")
    for note in res.notes:
        out.append(f"note: {note}")
    out.append("")
    out.append("PASS" if res.passed else f"FAIL ({len(res.failures)} checks failed)")
    return "\n".join(out)
