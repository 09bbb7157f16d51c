"""``compare_files``: the card of several files against one reference (see the package
docstring and docs/compare.md)."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field

import torch

from h3quant.errors import FindingError, H3QuantError, VerifyError
from h3quant.pipelines.compare.card import BlockDrift, CompareResult, FileCard, Metric, StepDrift
from h3quant.pipelines.compare.card import rank as rank_cards
from h3quant.pipelines.compare.facts import FileFacts, file_facts, pick_reference
from h3quant.pipelines.compare.reference import Dims, ReferenceRun
from h3quant.pipelines.compare.sampler import euler
from h3quant.pipelines.metrics import error_metrics
from h3quant.pipelines.verify.model import ModelInputs
from h3quant.runtime.probe import Probe

MAX_FILES = 256


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _no_progress(desc: str, total: int | None, unit: str):
    return _NoBar()


@dataclass(frozen=True)
class CompareOptions:
    inputs: ModelInputs = field(default_factory=ModelInputs)
    sigmas: tuple[float, ...] | None = None  # the sampling run's schedule; None: no sampling run
    device: str = "auto"
    mmap: bool = True
    backend: str | None = None
    probe: Probe | None = None
    # the planner's predicted frontier over the reference: drawn only when asked for (True;
    # refused for a quantized reference), at one streamed forward per candidate per block
    frontier: bool = False
    # judge each file against a fresh plain encode of the reference in its own formats
    # (pipelines.fresh_encode): one more one-forward run per distinct format mix
    expected: bool = True


def metric(got: torch.Tensor, want: torch.Tensor, psnr: bool = False) -> Metric:
    rel, sqnr, cos = error_metrics(got.float().cpu(), want)
    out = Metric(sqnr, rel, cos)
    if psnr:
        g, r = got.double().cpu().flatten(), want.double().flatten()
        mse = float(((g - r) ** 2).mean())
        peak = float(r.abs().max()) if r.numel() else 0.0
        out.psnr_db = math.inf if mse == 0 else (
            -math.inf if peak == 0 else 10.0 * math.log10(peak * peak / mse))
    return out


def _check_schedule(sigmas):
    if sigmas is None:
        return None
    from h3quant.runtime.model.schedule import check_schedule

    sched = check_schedule(sigmas)
    if not all(s > 0 for s in sched[:-1]):
        raise VerifyError("every sigma of the schedule but the last must be > 0")
    return sched


def compare_files(files, *, reference=None, options: CompareOptions | None = None,
                  progress=None, log=None) -> CompareResult:
    """The card of ``files`` against ``reference`` (or, without one, the most precise of the
    files). ``progress(desc, total, unit)`` returns a bar with ``update`` / ``close`` (files,
    blocks, steps); ``log(message)`` gets human notes. Raises VerifyError / ContainerError
    naming the file when a run cannot be set up."""
    from h3quant import __version__
    from h3quant.runtime.availability import require_device

    opts = options or CompareOptions()
    progress = progress or _no_progress
    files = [str(f) for f in files]
    if not files:
        raise VerifyError("give at least one file to compare")
    if len(files) > MAX_FILES:
        raise VerifyError(f"{len(files)} files: at most {MAX_FILES} per card")
    sched = _check_schedule(opts.sigmas)
    facts = [file_facts(f) for f in files]
    chosen = reference is None
    if chosen:
        if len(files) < 2:
            raise VerifyError("one file and no reference: give the reference (--reference) or "
                              "at least two files")
        ref_facts = pick_reference(facts)
        facts = [f for f in facts if f is not ref_facts]
    else:
        ref_facts = file_facts(reference)
    if opts.frontier and ref_facts.quantized:
        raise VerifyError(f"the planner's frontier needs a float reference; "
                          f"{ref_facts.path} is {ref_facts.label}", path=ref_facts.path)
    dev = require_device(opts.device, probe=opts.probe)
    dtype = dev.compute_dtype
    run = {"inputs": {k: v for k, v in vars(opts.inputs).items()}, "seed": opts.inputs.seed,
           "schedule": sched, "steps": None if sched is None else len(sched) - 1,
           "device": str(dev), "dtype": str(dtype).replace("torch.", ""),
           "reference_dtype": "float32 (CPU)", "h3quant_version": __version__,
           "sampler": "flow-matching Euler (docs/compare.md)"}
    notes = []
    if chosen:
        notes.append(f"no reference given: the most precise file, {ref_facts.path} "
                     f"({ref_facts.label}), is the reference")
    bad = data_findings(ref_facts.path)
    if bad:
        raise FindingError(f"the reference fails validate --deep: {bad[0]}"
                           + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                           path=ref_facts.path)
    with tempfile.TemporaryDirectory(prefix="h3quant-compare-") as work:
        ref, ref_card = _reference(ref_facts, opts, sched, dev, dtype, work, progress, log)
        encodes: dict = {}
        try:
            cards = []
            bar = progress("files", len(facts), "file")
            try:
                for f in facts:
                    if log is not None:
                        log(f"comparing {f.path} ({f.label})")
                    bad = data_findings(f.path)
                    if bad:  # validate --deep's verdict: not run, not ranked
                        card = FileCard(f, "file")
                        card.failures = bad
                        cards.append(card)
                    else:
                        cards.append(_file_card(f, ref, opts, sched, dev, dtype, work,
                                                progress))
                        _judge(cards[-1], ref_facts, ref, opts, dev, dtype, work, progress,
                               log, encodes)
                    bar.update(1)
            finally:
                bar.close()
            floor = noise_floor(ref_facts, ref, opts, dev, dtype)
        finally:
            ref.close()
    limiting = min(floor["video"], floor["audio"])
    rank_cards(cards, limiting)
    result = CompareResult(ref_card, cards, chosen, run, notes)
    result.floor = floor
    if opts.frontier:
        result.frontier = _frontier(ref_facts, opts, progress, log)
    return result


def _forward(model, opts, dtype, nudge: bool = False):
    """One forward of ``model`` on the card's inputs in ``dtype`` (each input moved by one ulp
    toward +inf with ``nudge``): its (video, audio) outputs, fp32 on the CPU."""
    video, audio, text = opts.inputs.tensors(model.video_channels, model.audio_channels,
                                             model.text_dim)
    if nudge:
        video, audio, text = (torch.nextafter(x, torch.full_like(x, math.inf))
                              for x in (video, audio, text))
    st = model.start(video.to(dtype), audio.to(dtype), text.to(dtype), opts.inputs.sigma)
    with torch.no_grad():
        for i in model.blocks:
            block = model.load_block(i, dtype)
            st.x = block(st.x, st.cond)
            del block
            model.release_block(i)
    return tuple(o.float().cpu() for o in model.finish(st))


def noise_floor(facts: FileFacts, ref: ReferenceRun, opts, dev, dtype) -> dict:
    """The reference against itself: one forward with every input moved by one ulp (CPU,
    float32) and, where the device computes in another dtype, one forward on the device in
    that dtype; per stream the lower SQNR. Differences it can explain are ties."""
    linear = "reference" if facts.quantized else "runtime"
    how = ["inputs moved by one ulp (CPU, float32)"]
    with _open(facts.path, "cpu", opts, linear) as model:
        got = [_forward(model, opts, torch.float32, nudge=True)]
    if dtype != torch.float32:
        with _open(facts.path, dev, opts, linear) as model:
            got.append(_forward(model, opts, dtype))
        how.append(f"{str(dtype).replace('torch.', '')} on {dev} against float32 on the CPU")
    out: dict = {"how": how}
    for k, name in enumerate(("video", "audio")):
        out[name] = min(error_metrics(g[k], ref.outputs[k])[1] for g in got)
    return out


def _judge(card: FileCard, ref_facts: FileFacts, ref: ReferenceRun, opts, dev, dtype, work,
           progress, log, encodes: dict) -> None:
    """Flag what is clearly worse than the fresh plain encode of the reference in the file's
    formats (``fresh_encode``), or, where none can be made, below the fixed per-format limits."""
    from h3quant.pipelines import fresh_encode as fe

    if not opts.expected:
        return
    key = None
    scanned = None
    try:
        scanned = fe.file_layers(card.facts.path)
        layers = scanned[0]
        key = json.dumps(sorted((k, sorted(v.items())) for k, v in layers.items()))
    except H3QuantError:
        layers = None
    if layers == {}:  # a float file: no format to encode in, nothing to judge
        return
    if key is not None and key in encodes:
        enc, runs = encodes[key]
    else:
        if log is not None:
            log(f"encoding the reference afresh in the formats of {card.facts.path}")
        # each encode's figures are kept: the file, the size of a model, is removed once run
        enc, runs = fe.judged_encode(card.facts.path, ref_facts.path, lambda p: _file_card(
            file_facts(p), ref, opts, None, dev, dtype, work, progress), mmap=opts.mmap,
            log=log, scanned=scanned)
        if key is not None:
            encodes[key] = (enc, runs)
    what = enc.describe()
    if runs is None:
        _judge_fixed(card, what)
        return
    outputs = fe.lenient([(label, {k: m.sqnr_db for k, m in exp.outputs.items()})
                          for label, exp in runs])
    blocks = fe.lenient([(label, {d.block: d.local_sqnr_db for d in exp.drift})
                         for label, exp in runs])
    card.expected = {"what": what,
                     "outputs": {k: v for k, (v, _) in outputs.items()},
                     "blocks": {k: v for k, (v, _) in blocks.items()}}
    if len(runs) > 1:  # which encode gave each figure (the lower of the two)
        card.expected["by"] = {"outputs": {k: by for k, (_, by) in outputs.items()},
                               "blocks": {k: by for k, (_, by) in blocks.items()}}
    bm, om = enc.margin_db(fe.BLOCK_MARGIN_DB), enc.margin_db(fe.OUTPUT_MARGIN_DB)
    card.expected["margin_db"] = {"block": bm, "output": om}
    for d in card.drift:
        e, by = blocks.get(d.block, (math.nan, None))
        if _below(d.local_sqnr_db, e, bm):
            card.flags.append(f"block {d.block}: {_f(d.local_sqnr_db)} dB alone against "
                              f"{_f(e)} dB for the {by} fresh encode (margin {bm:g} dB)")
    for k, m in card.outputs.items():
        e, by = outputs[k]
        if _below(m.sqnr_db, e, om):
            card.flags.append(f"{k} output: {_f(m.sqnr_db)} dB against {_f(e)} dB for the "
                              f"{by} fresh encode (margin {om:g} dB)")
    if enc.skipped:
        _judge_fixed(card, what)


def _judge_fixed(card: FileCard, what: str) -> None:
    """The sanity floor: the fixed per-format block limit less the block margin, on each block
    alone (docs/verify.md; not on the outputs, whose chained error no fixed limit fits across
    models)."""
    from h3quant.pipelines import fresh_encode as fe

    from h3quant.pipelines.verify.result import SqnrLimits

    formats = [f for f in card.facts.formats if not f.startswith(("float:", "gguf:"))]
    low = (card.facts.bits_per_weight or 16) < 6
    lim = SqnrLimits().limit(formats) if formats else (
        SqnrLimits().sqnr_db_w4a8 if low else SqnrLimits().sqnr_db_int8)
    card.notes.append(what)
    for d in card.drift:  # the limit less the block margin: a floor, not a verdict on quality
        if _below(d.local_sqnr_db, lim, fe.BLOCK_MARGIN_DB):
            card.flags.append(f"block {d.block}: {_f(d.local_sqnr_db)} dB alone, under the "
                              f"fixed limit of {lim:g} dB less {fe.BLOCK_MARGIN_DB:g} dB")


def _below(got: float, want: float, margin: float) -> bool:
    if math.isnan(got):
        return True
    return math.isfinite(want) and got < want - margin


def _f(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else str(x)


def data_findings(path: str) -> list[str]:
    """validate --deep's error findings on the file's values (D1xx; G104 for GGUF), as text:
    a file compare would otherwise run through NaN scales gets the verdict validate gives."""
    from h3quant.findings import Severity
    from h3quant.formats.gguf.reader import is_gguf
    from h3quant.pipelines.headers.gguf import validate_gguf
    from h3quant.pipelines.headers.validate import validate_checkpoint

    if is_gguf(path):
        findings = validate_gguf(path, deep=True)[1]
    else:
        findings = validate_checkpoint(path, deep=True).findings
    return [f"[{f.code}] " + (f"{f.tensor}: " if f.tensor else "") + f.message
            for f in findings if f.severity is Severity.ERROR
            and (f.code.startswith("D") or f.code == "G104")]


def _frontier(facts: FileFacts, opts: CompareOptions, progress, log) -> list[dict]:
    """The planner's predicted frontier over the float reference (``plan.frontier``): one
    sensitivity pass on the card's inputs, nothing converted."""
    from h3quant.pipelines.plan.frontier import predicted_frontier

    if log is not None:
        log(f"planner frontier over {facts.path}: one streamed forward per candidate per block")
    bar = progress("planner", None, "block")

    def on_block(done, total):
        bar.total = total
        bar.update(1)

    try:
        points = predicted_frontier(facts.path, inputs=opts.inputs, mmap=opts.mmap,
                                    on_block=on_block)
    finally:
        bar.close()
    keep = ("name", "formats", "predicted_bytes", "predicted_sqnr_db", "predicted_min_sqnr_db",
            "target_sqnr_db")
    return [{k: v for k, v in p.to_dict().items() if k in keep} for p in points]


def _open(path, device, opts, linear="runtime"):
    from h3quant.runtime.model.model import H3Model

    return H3Model.open(path, device, mmap=opts.mmap, linear=linear,
                        backend=opts.backend if linear == "runtime" else None, probe=opts.probe)


def _reference(facts: FileFacts, opts, sched, dev, dtype, work, progress, log):
    if log is not None:
        log(f"reference {facts.path} ({facts.label}): CPU, float32")
    linear = "reference" if facts.quantized else "runtime"
    steps = 0 if sched is None else len(sched) - 1
    with _open(facts.path, "cpu", opts, linear) as model:
        if model.head_bank > 1 and sched is None:
            raise VerifyError(f"final_layer holds a bank of {model.head_bank} output heads: "
                              "give the sampler's schedule (--steps N or --sigmas)",
                              path=facts.path)
        bar = progress("reference", len(model.blocks) + steps, "block")
        try:
            ref = ReferenceRun(model, opts.inputs, sched, work, bar=bar)
        finally:
            bar.close()
    card = FileCard(facts, "reference")
    card.notes.append("runs on the CPU in float32" +
                      (" (its quantized weights in float math)" if facts.quantized else ""))
    if ref.step_seconds:
        card.step_seconds = sum(ref.step_seconds) / len(ref.step_seconds)
    if sched is not None and dev.kind != "cpu":  # its time on the compared device
        with _open(facts.path, dev, opts, linear) as model:
            times: list[float] = []
            v, a, t = opts.inputs.tensors(model.video_channels, model.audio_channels,
                                          model.text_dim)
            euler(model, v, a, t, sched, dtype, lambda i, xv, xa, s: times.append(s),
                  steps=min(2, len(sched) - 1))
            card.step_seconds = times[-1]
            card.notes.append(f"time per step on {dev} ({str(dtype).replace('torch.', '')})")
    return ref, card


def _check_dims(model, ref: ReferenceRun, path: str) -> None:
    got, want = Dims.of(model), ref.dims
    if got != want:
        raise VerifyError(f"the file does not match the reference: hidden {got.hidden} vs "
                          f"{want.hidden}, {len(got.blocks)} vs {len(want.blocks)} blocks, text "
                          f"width {got.text_dim} vs {want.text_dim}, {got.head_bank} vs "
                          f"{want.head_bank} output heads", path=path)


def _file_card(facts: FileFacts, ref: ReferenceRun, opts, sched, dev, dtype, work,
               progress) -> FileCard:
    card = FileCard(facts, "file")
    with _open(facts.path, dev, opts) as model:
        _check_dims(model, ref, facts.path)
        video, audio, text = opts.inputs.tensors(model.video_channels, model.audio_channels,
                                                 model.text_dim)
        st = model.start(video.to(dtype), audio.to(dtype), text.to(dtype), opts.inputs.sigma,
                         sigmas=sched)
        bar = progress("blocks", len(model.blocks), "block")
        try:
            for k, i in enumerate(model.blocks):
                block = model.load_block(i, dtype)
                x_in = ref.state(k)
                with torch.no_grad():
                    local = block(x_in.to(device=model.tdev, dtype=dtype), st.cond)
                    st.x = block(st.x, st.cond)
                del block
                model.release_block(i)
                want = ref.state(k + 1)
                # alone: the block's residual update on the reference's input vs the reference's
                card.drift.append(BlockDrift(i, error_metrics(st.x.float().cpu(), want)[1],
                                             error_metrics(local.float().cpu() - x_in,
                                                           want - x_in)[1]))
                del local, x_in
                bar.update(1)
        finally:
            bar.close()
        for name, got, want in zip(("video", "audio"), model.finish(st), ref.outputs):
            card.outputs[name] = metric(got, want)
        del st
        if sched is not None:
            bar = progress("steps", len(sched) - 1, "step")

            def on_step(i, xv, xa, seconds):
                rv, ra = ref.trajectory[i]
                card.steps.append(StepDrift(i, sched[i], ref.heads[i], metric(xv, rv).sqnr_db,
                                            metric(xa, ra).sqnr_db, seconds))
                bar.update(1)

            try:
                xv, xa = euler(model, video, audio, text, sched, dtype, on_step)
            finally:
                bar.close()
            rv, ra = ref.trajectory[-1]
            card.final = {"video": metric(xv, rv, psnr=True), "audio": metric(xa, ra, psnr=True)}
            card.step_seconds = sum(s.seconds for s in card.steps) / len(card.steps)
    return card
