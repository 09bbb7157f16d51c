"""Verify the whole converted model: the H3 forward of the checkpoint against a float reference.

Both models run the real forward (``h3quant.runtime.model.H3Model``), streamed block by block
and interleaved, on the same seeded inputs: the model under test on the device's own path, the
reference on the CPU in fp32. Reported: the output SQNR and the drift after every block; the
limits (``ModelThresholds``) are in docs/verify.md.

With a sampler schedule (``sigmas``, e.g. ``runtime.model.schedule.shifted_schedule(8)``) the
comparison runs once per step at that step's sigma, so a bank of output heads is checked on
every step's combination of heads; the drift is reported for the first step.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from h3quant.errors import VerifyError
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.pipelines.metrics import error_metrics
from h3quant.formats import registry
from h3quant.pipelines.verify import provenance
from h3quant.pipelines.verify.result import SqnrLimits, Verdict, by_encode
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3quant.runtime.devices import Device


@dataclass(frozen=True)
class ModelInputs:
    frames: int = 2
    height: int = 16
    width: int = 16
    audio_frames: int = 32
    text_tokens: int = 64
    sigma: float = 0.6
    seed: int = 0
    file: str | None = None  # the latents come from this inputs file (pipelines.inputs_file)

    def __post_init__(self) -> None:  # bounded: at most MAX_MODEL_ROWS packed rows
        from h3quant.limits import check_model_rows

        check_model_rows(self.frames, self.height, self.width, self.audio_frames,
                         self.text_tokens)

    @classmethod
    def from_file(cls, path, sigma: float = 0.6) -> "ModelInputs":
        """The inputs held in ``path`` (sizes from its header; its sigma when it has one, else
        ``sigma``). UsageError naming the file and tensor when it is malformed or too large."""
        from h3quant.pipelines.inputs_file import load_sigma, read_header

        dims = read_header(path)
        own = load_sigma(path)
        return cls(**dims, sigma=sigma if own is None else own, seed=0, file=str(path))

    def tensors(self, video_channels: int, audio_channels: int, text_dim: int):
        """fp32 (video, audio, text) on the CPU, seeded (the same values on every device) or
        read from the inputs file."""
        if self.file is not None:
            from h3quant.pipelines.inputs_file import load_tensors

            return load_tensors(self.file, video_channels, audio_channels, text_dim)
        g = torch.Generator().manual_seed(self.seed)
        video = torch.randn(1, video_channels, self.frames, self.height, self.width, generator=g)
        audio = torch.randn(1, audio_channels, 2, self.audio_frames, generator=g)
        text = torch.randn(1, self.text_tokens, text_dim, generator=g)
        return video, audio, text


ModelThresholds = SqnrLimits  # the outputs and the last hidden state are held to the block limits


@dataclass
class Drift:
    block: int
    sqnr_db: float
    rel_err: float
    cosine: float


@dataclass
class OutputCheck:
    name: str  # video, audio, hidden (the state after the last block run)
    sqnr_db: float
    rel_err: float
    cosine: float
    limit_db: float
    passed: bool
    expected_by: str | None = None  # the fresh encode whose figure set ``limit_db`` (None: fixed)


@dataclass
class ModelVerifyResult(Verdict):
    path: str
    reference: str  # the reference checkpoint, or "dequantized"
    device: str
    inputs: ModelInputs
    blocks_total: int
    depth: int
    formats: list[str]
    thresholds: ModelThresholds
    drift: list[Drift] = field(default_factory=list)
    outputs: list[OutputCheck] = field(default_factory=list)
    backends: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    head_bank: int = 1  # output heads the file stacks
    steps: list[dict] = field(default_factory=list)  # per step: step, sigma, heads [start, stop)
    provenance: dict[str, dict] = field(default_factory=dict)  # int8 layers judged as W4A8
    # the fresh plain encode of the reference in the file's formats the outputs were judged
    # against: {"what": text, "margin_db": dB, "outputs": {name: dB}, "by": {name: the encode
    # that gave it}}; None: the fixed limits
    expected: dict | None = None

    @property
    def final_layer_run(self) -> bool:
        return self.depth == self.blocks_total

    @property
    def failures(self) -> list[str]:
        return [f"{o.name}: SQNR {o.sqnr_db:.2f} dB < {o.limit_db} dB" + by_encode(o.expected_by)
                for o in self.outputs if not o.passed]

    def to_dict(self) -> dict:
        return self.verdict_dict({
            "mode": "model", "path": self.path, "reference": self.reference,
            "device": self.device, "inputs": asdict(self.inputs),
            "blocks_total": self.blocks_total, "depth": self.depth,
            "final_layer_run": self.final_layer_run, "formats": self.formats,
            "thresholds": asdict(self.thresholds),
            "outputs": [asdict(o) for o in self.outputs],
            "drift": [asdict(d) for d in self.drift],
            "backends": self.backends, "notes": self.notes,
            "head_bank": self.head_bank, "steps": self.steps, "provenance": self.provenance,
            "expected": self.expected,
        })


def _formats(model) -> list[str]:
    from h3quant.runtime.loader import LEGACY_FP8_FORMAT, has_scaled_fp8_marker

    p = model.prefix + "blocks."
    found = {lay.fields["format"] for n, lay in model.scan.layers.items()
             if n.startswith(p) and lay.fields is not None}
    if has_scaled_fp8_marker(model.ckpt) and any(  # legacy scaled fp8 loads as float8_e4m3fn
            n.startswith(p) and f"{n}.scale_weight" in model.ckpt.tensors for n in model.scan.layers):
        found.add(LEGACY_FP8_FORMAT)
    return sorted(found)


def _backends(block) -> dict[str, int]:
    out: dict[str, int] = {}
    for mod in block.linears().values():
        name = str(getattr(mod, "backend_name", "?"))
        out[name] = out.get(name, 0) + 1
    return out


def verify_model(
    path: str | os.PathLike,
    *,
    reference: str | os.PathLike | None = None,
    device: str | Device = "auto",
    inputs: ModelInputs | None = None,
    depth: int | None = None,
    mmap: bool = True,
    thresholds: ModelThresholds | None = None,
    backend: str | None = None,
    probe=None,
    on_block=None,
    sigmas=None,
    expected: bool = True,
    log=None,
) -> ModelVerifyResult:
    """Run both forwards and compare (see the module docstring). ``on_block(done, total)`` is
    called after each block (progress). ``sigmas``: a sampler schedule (every step is checked;
    ``inputs.sigma`` is then unused). With a ``reference`` and ``expected``, every output is
    judged against a fresh plain encode of the reference in the file's formats, run the same
    way (``judge_relative``; ``log``: where its size goes); the fixed limits then apply only
    where no encode can be made.
    Raises VerifyError when the run cannot be set up."""
    from h3quant.runtime.availability import require_device
    from h3quant.runtime.model.model import H3Model
    from h3quant.runtime.model.schedule import check_schedule

    inputs = inputs or ModelInputs()
    sched = check_schedule(sigmas) if sigmas is not None else None
    if sched is not None and not sched[0] > 0:
        raise VerifyError("the schedule's first sigma must be > 0")
    th = thresholds or ModelThresholds()
    dev = require_device(device, probe=probe)
    dtype = dev.compute_dtype
    with H3Model.open(path, dev, mmap=mmap, backend=backend, probe=probe) as model, \
            H3Model.open(reference or path, "cpu", mmap=mmap,
                         linear="runtime" if reference else "reference",
                         any_layout=bool(reference)) as ref:
        formats = _formats(model)
        if not formats:
            raise VerifyError("the checkpoint's blocks hold no quantized layer; nothing to "
                              "verify", path=path)
        if reference:
            _check_reference(model, ref)
        total = len(model.blocks)
        if depth is not None and (not isinstance(depth, int) or not 1 <= depth <= total):
            raise VerifyError(f"depth must be in 1..{total} (the checkpoint has {total} blocks), "
                              f"got {depth!r}")
        run = model.blocks[:depth] if depth else model.blocks
        result = ModelVerifyResult(str(path), str(reference) if reference else "dequantized",
                                   str(dev), inputs, total, len(run), formats, th)
        result.head_bank = model.head_bank
        if not registry.low_bit(formats):  # one int8 layer judged as W4A8 sets the limit
            result.provenance = provenance.to_json(provenance.judge_checkpoint(
                model.ckpt, model.scan, (model.prefix + "blocks.",), first=True).values())
            result.notes.extend(provenance.notes(result.provenance, first=True))
        if reference and ref.head_bank != model.head_bank:
            raise VerifyError(f"the reference holds {ref.head_bank} output head(s), the "
                              f"checkpoint {model.head_bank}", path=ref.path)
        if model.head_bank > 1 and sched is None:
            raise VerifyError(f"final_layer.video_out / audio_out hold a bank of "
                              f"{model.head_bank} heads: pass the sampler's schedule "
                              "(--steps N or --sigmas) to check each step's head", path=path)
        points = [(inputs.sigma, None)] if sched is None else \
            [(sg, i) for i, sg in enumerate(sched[:-1]) if sg > 0]
        share = dev.kind == "cpu" and _same_text_path(model, ref)
        if share:
            result.notes.append("text refiner computed once: both files hold identical float "
                                "condition_proj / token_refiner tensors and both run them in "
                                "fp32 on the CPU (the results would be bit-identical)")
        for n_point, (sigma, step) in enumerate(points):
            _compare_at(model, ref, inputs, sigma, sched, step, run, dtype, share, result,
                        drift=n_point == 0, on_block=on_block if n_point == 0 else None)
        if not result.final_layer_run:
            result.notes.append(f"--depth {len(run)} of {total} blocks: the final layer was "
                                "skipped; only the hidden-state drift is checked")
        if len(points) > 1:
            result.notes.append(f"{len(points)} steps of the schedule checked; the drift "
                                "table is the first step's")
        if reference is None:
            result.notes.append("reference = the file's own quantized weights in float math (no "
                                "activation quantization): this tests the runtime, not the "
                                "weights; pass --reference to compare with the original")
    if reference is not None and expected:
        judge_relative(result, path, reference, dict(
            device=dev, inputs=inputs, depth=depth, mmap=mmap, thresholds=th,
            backend=backend, probe=probe, sigmas=sigmas), log=log)
    return result


def judge_relative(result: ModelVerifyResult, path, reference, run: dict,
                   log=None) -> None:
    """Hold each output to the fresh plain encode of the reference in the file's formats
    (``pipelines.fresh_encode``) run on the same device and inputs, less the margin: the
    error the format is expected to have on this model. Where layers also have an encode in
    their stored dtype, each output is held to the lower SQNR of the two encodes (``by`` names
    which). Where nothing can be re-encoded the fixed limits stay (the note says what was
    compared)."""
    from h3quant.pipelines import fresh_encode as fe

    enc, runs = fe.judged_encode(str(path), str(reference), lambda p: verify_model(
        p, reference=reference, expected=False, **run), mmap=run["mmap"],
        log=log)
    if runs is None:
        result.notes.append(enc.describe())
        return
    picked = fe.lenient([(label, {o.name: o.sqnr_db for o in exp.outputs})
                         for label, exp in runs])
    margin = enc.margin_db(fe.OUTPUT_MARGIN_DB)
    result.expected = {"what": enc.describe(), "margin_db": margin,
                       "outputs": {k: v for k, (v, _) in picked.items()},
                       "by": {k: by for k, (_, by) in picked.items()}}
    for o in result.outputs:
        e, by = picked.get(o.name, (None, None))
        if e is None or not math.isfinite(e):
            continue
        o.limit_db = round(e - margin, 2)
        o.passed = o.sqnr_db >= o.limit_db  # NaN fails
        o.expected_by = by
    two = (f"; each output held to the lower SQNR of the two encodes ({fe.set_by(picked)})"
           if len(runs) > 1 else "")
    result.notes.append(f"limits: {enc.describe()}, {margin:g} dB below its "
                        f"SQNR on the same inputs (the fixed per-format limits do not apply)"
                        f"{two}")


def _compare_at(model, ref, inputs, sigma, sched, step, run, dtype, share, result, *, drift,
                on_block) -> None:
    """One comparison at ``sigma`` (step ``step`` of ``sched``, or a lone sigma)."""
    video, audio, text = inputs.tensors(model.video_channels, model.audio_channels,
                                        model.text_dim)
    sr = ref.start(video, audio, text, sigma, sigmas=sched)
    shared = sr.x[:inputs.text_tokens] if share else None
    sq = model.start(video.to(dtype), audio.to(dtype), text.to(dtype), sigma,
                     text_embed=shared, sigmas=sched)
    limit = result.thresholds.limit(result.formats + ([provenance.W4A8] if result.provenance
                                                      else []))
    last = None
    for n, i in enumerate(run):
        block = model.load_block(i, dtype)
        if drift:
            for k, v in _backends(block).items():
                result.backends[k] = result.backends.get(k, 0) + v
        with torch.no_grad():
            sq.x = block(sq.x, sq.cond)
        del block
        model.release_block(i)
        ref.run_block(sr, i)
        if drift or n == len(run) - 1:
            rel, sqnr, cos = error_metrics(sq.x.float().cpu(), sr.x)
            last = Drift(i, sqnr, rel, cos)
            if drift:
                result.drift.append(last)
        if on_block is not None:
            on_block(n + 1, len(run))
    tag = "" if step is None else f" (step {step})"
    if step is not None:
        head = sq.head
        result.steps.append({"step": step, "sigma": sigma,
                             "heads": None if head is None else [head.start, head.stop]})
    if last is None:
        raise VerifyError("no block was run")
    result.outputs.append(OutputCheck("hidden" + tag, last.sqnr_db, last.rel_err, last.cosine,
                                      limit, last.sqnr_db >= limit))
    if result.final_layer_run:
        for name, got, want in zip(("video", "audio"), model.finish(sq), ref.finish(sr)):
            rel, sqnr, cos = error_metrics(got.float().cpu(), want)
            result.outputs.append(OutputCheck(name + tag, sqnr, rel, cos, limit, sqnr >= limit))


def _same_text_path(model, ref) -> bool:
    """True when both checkpoints hold byte-identical float text-path tensors."""
    names = model.text_tensors()
    if not names or names != [n.replace(ref.prefix, model.prefix, 1) for n in ref.text_tensors()]:
        return False
    for n in names:
        a = model.ckpt.tensors[n]
        b = ref.ckpt.tensors.get(ref.prefix + n[len(model.prefix):])
        if b is None or a.dtype != b.dtype or list(a.shape) != list(b.shape) \
                or a.dtype not in FLOAT_DTYPES:
            return False
    for n in names:
        m = ref.prefix + n[len(model.prefix):]
        same = torch.equal(model.ckpt.read(n), ref.ckpt.read(m))
        for ck, name in ((model.ckpt, n), (ref.ckpt, m)):  # keep RSS flat
            ck.file_of(name).release_pages(ck.info(name))
        if not same:
            return False
    return True


def _check_reference(model, ref) -> None:
    q = [n for n, lay in ref.scan.layers.items() if lay.fields is not None]
    if q:
        raise VerifyError(f"the reference checkpoint must be a float checkpoint; {q[0]} is "
                          f"quantized ({ref.scan.layers[q[0]].fields['format']})",
                          path=ref.path, tensor=q[0])
    if (ref.hidden, ref.blocks, ref.text_dim) != (model.hidden, model.blocks, model.text_dim):
        raise VerifyError(f"the reference does not match the checkpoint: hidden {ref.hidden} vs "
                          f"{model.hidden}, {len(ref.blocks)} vs {len(model.blocks)} blocks, "
                          f"text width {ref.text_dim} vs {model.text_dim}", path=ref.path)
