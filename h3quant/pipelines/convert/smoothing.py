"""``convert --calibration S --smooth auto``: smoothing chosen per layer and folded into the
tensors the conversion reads (``calibration.smooth`` has the method).

Before the plan, for each DiT block linear the run re-encodes into a format whose codec has a
calibrated or plain encoder, the factors are searched on the statistics (the layer's own target
format: a ``--layer`` / ``--recipe`` rule's, else ``--to``); the chosen ones are folded, in
float, into the input seen through a ``SourceView`` (the layer's weight times ``s``, the
block's norm weight and adaLN shift rows, or the v / up rows, divided by ``s``; powers of two,
so exactly), after any ``--lora`` is baked. Everything after (plan, error feedback, AWQ
scaling, ConvRot rotation inside each encoder) sees an ordinary float checkpoint that computes
what the input does, and statistics divided the same way (``divided``): ``x / s``.

Not smoothed: layers kept, copied or written as float; layers whose weight, or any tensor the
fold changes, is not stored as a float (an fp8 or quantized input layer); awq-w4a16 targets
(AWQ's own channel scaling does this for a weight-only format). Without ``--smooth auto`` none
of this runs and the output is byte for byte what it was.
"""

from __future__ import annotations

import json
import math

from h3quant.errors import UsageError
from h3quant.h3.provenance import SMOOTHING_KEY

HEADER_KEY = SMOOTHING_KEY  # JSON list of the smoothed layers
FLOATS = ("F32", "BF16", "F16")


def _block_names(tensors) -> dict[str, str]:
    """``blocks.{i}`` key -> the block's tensor name prefix, for every DiT block in ``tensors``."""
    from h3quant.calibration.stats import layer_key

    out = {}
    for name in tensors:
        if name.endswith(".attn.qkv_proj.weight"):
            layer = name[:-len(".weight")]
            key = layer_key(layer)
            if key is not None:
                out[key[:-len(".attn.qkv_proj")]] = layer[:-len("attn.qkv_proj")]
    return out


def _weight_share(st, codec, marker) -> float:
    """How much of the RTN weight error is left after error feedback: ``10^(-gain / 10)`` with
    the layer's predicted gain (1 for a format without a calibrated encoder, or too few rows)."""
    if not codec.spec.encoding.calibrates or st.rows < st.k:
        return 1.0
    convrot = codec.spec.reading.uses_convrot(marker)
    g = int((marker or {}).get("convrot_groupsize", 256))
    return 10.0 ** (-max(0.0, st.predicted_gain_db(convrot, g)) / 10.0)


def eligible(codec) -> bool:
    """Whether a layer re-encoded by ``codec`` is searched: a quantized format that does not
    scale its own channels (AWQ's channel scaling does this for a weight-only format)."""
    return bool(codec.spec.quantized) and not codec.spec.encoding.scales_channels


def touched(prefix: str, lin: str) -> list[str]:
    """The tensors (full names) whose storage the fold of ``prefix + lin`` changes."""
    from h3quant.calibration import smooth

    out = [f"{prefix}{lin}.weight"]
    if lin in smooth.NORM_OF:
        return out + [prefix + smooth.NORM_OF[lin], prefix + "adaln_proj.linear.weight",
                      prefix + "adaln_proj.linear.bias"]
    return out + [prefix + smooth.ROWS_OF[lin][0] + ".weight"]


_CHOSEN: dict = {}  # memo of layer_choice: its inputs' digest -> Choice (a pure function)
_CHOSEN_MAX = 4096


def layer_choice(name: str, w, dtype: str, st, codec, marker):
    """The smoothing ``convert --smooth auto`` chooses for layer ``name`` (float weight ``w``
    [N, K] stored as ``dtype``, its ``LayerStats`` ``st``, target ``codec`` / ``marker``): a
    ``Choice``, or None where the statistics' width is not the weight's (convert refuses the
    layer when it runs). The search is a pure function of these inputs, so a repeated call
    with the same weight, statistics rows and target (``plan --smooth auto`` then ``convert``
    in one process) returns the earlier choice instead of searching again."""
    import hashlib

    import torch

    from h3quant.calibration import smooth

    if not st.has_rows:
        raise UsageError("--smooth: the statistics hold no channel maxima or sampled rows "
                         "(written by an earlier 'h3quant capture'); capture them again",
                         path=getattr(st, "path", None), tensor=name)
    if st.k != w.shape[1]:
        return None
    w = w.float().contiguous()
    x_max, sample = st.channel_absmax().float().contiguous(), st.sample().float().contiguous()
    share = _weight_share(st, codec, marker)
    digest = hashlib.sha256()
    for t in (w, x_max, sample):
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.numpy().tobytes())
    digest.update(json.dumps([codec.spec.name, marker, dtype, share, smooth.ALPHAS,
                              smooth.MIN_GAIN_DB, smooth.SEARCH_ROWS],
                             sort_keys=True, default=str).encode())
    key = digest.hexdigest()
    if key in _CHOSEN:
        return _CHOSEN[key]
    choice = smooth.choose(w, x_max, sample, codec, marker, weight_share=share)
    if choice.s is not None:
        from h3quant.formats.container.dtypes import to_torch

        top = float(w.abs().amax(0).mul(choice.s).max())
        if to_torch(dtype) == torch.float16 and not top < 65504.0 or not math.isfinite(top):
            choice = smooth.Choice(None, 0.0, choice.modelled_db,
                                   note="the scaled weight leaves its dtype's range")
    if len(_CHOSEN) >= _CHOSEN_MAX:
        _CHOSEN.clear()
    _CHOSEN[key] = choice
    return choice


def search(view, stats, options, log) -> tuple[dict, dict]:
    """(layer name -> ``s``, layer name -> report entry) of every smoothed layer of ``view``."""
    from h3quant.calibration import smooth

    tensors = view.tensors
    found: dict = {}
    report: dict[str, dict] = {}
    for key, prefix in sorted(_block_names(tensors).items(),
                              key=lambda kv: int(kv[0].split(".")[1])):
        for lin in smooth.SMOOTHED:
            name = prefix + lin
            _, lopts = options.for_layer(name)
            if lopts is None or not options.filtered(name) or not eligible(lopts.codec):
                continue
            if any(t not in tensors or tensors[t].dtype not in FLOATS
                   for t in touched(prefix, lin)):
                report[name] = {"smoothed": False, "note": "a tensor the fold needs is not "
                                "stored as a float: not smoothed"}
                continue
            st = stats.layer(name)
            if st is None:
                continue
            if not st.has_rows:
                raise UsageError("--smooth: the statistics hold no channel maxima or sampled "
                                 "rows (written by an earlier 'h3quant capture'); capture them "
                                 "again", path=stats.path, tensor=f"{key}.{lin}")
            w = view.read(f"{name}.weight")
            choice = layer_choice(name, w, tensors[f"{name}.weight"].dtype, st, lopts.codec,
                                  lopts.marker())
            st.release()
            del w
            if choice is None:
                continue  # convert refuses it when the layer runs
            report[name] = choice.to_dict()
            db = choice.modelled_db
            log(f"smoothing {name}: " + (f"alpha {choice.alpha:g}, " if choice.s is not None
                                         else "not smoothed, ")
                + f"modelled output SQNR {db.get('plain')} -> {db.get('smoothed')} dB")
            if choice.s is not None:
                found[name] = choice.s
    return found, report


def fold_into(view, found: dict) -> None:
    """Show ``view``'s tensors with the factors ``found`` folded in (``calibration.smooth``)."""
    from h3quant.calibration import smooth

    by_block: dict[str, dict] = {}
    for name, s in found.items():
        lin = next(x for x in smooth.SMOOTHED if name.endswith(x))
        by_block.setdefault(name[:-len(lin)], {})[lin] = s
    for prefix, factors_of in by_block.items():
        t = view.tensors
        ops = smooth.fold_plan(factors_of, int(t[prefix + "norm1.weight"].shape[0]),
                               int(t[prefix + "attn.qkv_proj.weight"].shape[0]),
                               int(t[prefix + "mlp.fc1.weight"].shape[0]))
        for rel, o in ops.items():
            name = prefix + rel
            if name not in t:
                continue  # a bias the layer does not have
            current, base = view.current(name)

            def compute(current=current, o=o):
                return smooth.apply_ops(current(), o)
            view.replace(name, t[name].dtype, tuple(t[name].shape), compute, base)


def apply(view, options, src, log) -> tuple[dict, dict]:
    """Search and fold (see the module text); (layer -> ``s``, layer -> report entry)."""
    from h3quant.calibration.fingerprint import checkpoint_fingerprint
    from h3quant.calibration.stats import Statistics

    with Statistics(options.calibration) as stats:
        stats.check_checkpoint(checkpoint_fingerprint(src))
        found, report = search(view, stats, options, log)
    fold_found(view, found, report, log)
    return found, report


def fold_found(view, found: dict, report: dict, log) -> None:
    """Fold the factors ``found`` (``search``'s, or the one pass's block by block) into ``view``
    and name the smoothed layers in its header."""
    fold_into(view, found)
    if found:  # the smoothed layers, for tools reading the output (the report has the details)
        view.extra_metadata[HEADER_KEY] = json.dumps(sorted(found), separators=(",", ":"))
    log(f"smoothing: {len(found)} of {len(report)} searched layers smoothed")


__all__ = ["HEADER_KEY", "apply", "eligible", "fold_found", "fold_into", "layer_choice",
           "search", "touched"]
