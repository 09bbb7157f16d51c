"""Verify the whole converted model: the H3 forward of the checkpoint against a float reference.

Both models run the real forward (``h3quant.runtime.model.H3Model``), streamed block by block
and interleaved, on the same seeded inputs: the model under test on the device's own path, the
reference on the CPU in fp32. Reported: the output SQNR and the drift after every block; the
limits (``ModelThresholds``) are in docs/verify.md.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from h3quant.errors import VerifyError
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.pipelines.metrics import error_metrics
from h3quant.pipelines.verify.result import SqnrLimits, Verdict


@dataclass(frozen=True)
class ModelInputs:
    frames: int = 2
    height: int = 16
    width: int = 16
    audio_frames: int = 32
    text_tokens: int = 64
    sigma: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:  # bounded: at most MAX_MODEL_ROWS packed rows
        from h3quant.limits import check_model_rows

        check_model_rows(self.frames, self.height, self.width, self.audio_frames,
                         self.text_tokens)

    def tensors(self, video_channels: int, audio_channels: int, text_dim: int):
        """Seeded fp32 (video, audio, text) on the CPU: the same values on every device."""
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

    @property
    def final_layer_run(self) -> bool:
        return self.depth == self.blocks_total

    @property
    def failures(self) -> list[str]:
        return [f"{o.name}: SQNR {o.sqnr_db:.2f} dB < {o.limit_db} dB"
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
        })


def _formats(model) -> list[str]:
    p = model.prefix + "blocks."
    return sorted({lay.fields["format"] for n, lay in model.scan.layers.items()
                   if n.startswith(p) and lay.fields is not None})


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
    device: str = "auto",
    inputs: ModelInputs | None = None,
    depth: int | None = None,
    mmap: bool = True,
    thresholds: ModelThresholds | None = None,
    backend: str | None = None,
    probe=None,
    on_block=None,
) -> ModelVerifyResult:
    """Run both forwards and compare (see the module docstring). ``on_block(done, total)`` is
    called after each block (progress). Raises VerifyError when the run cannot be set up."""
    from h3quant.runtime.devices import parse_device
    from h3quant.runtime.model.model import H3Model

    inputs = inputs or ModelInputs()
    th = thresholds or ModelThresholds()
    dev = parse_device(device, probe=probe)
    dtype = torch.float32 if dev.kind == "cpu" else torch.bfloat16
    with H3Model.open(path, dev, mmap=mmap, backend=backend, probe=probe) as model, \
            H3Model.open(reference or path, "cpu", mmap=mmap,
                         linear="runtime" if reference else "reference") as ref:
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
        video, audio, text = inputs.tensors(model.video_channels, model.audio_channels,
                                            model.text_dim)
        sr = ref.start(video, audio, text, inputs.sigma)
        shared = None
        if dev.kind == "cpu" and _same_text_path(model, ref):
            shared = sr.x[:inputs.text_tokens]
            result.notes.append("text refiner computed once: both files hold identical float "
                                "condition_proj / token_refiner tensors and both run them in "
                                "fp32 on the CPU (the results would be bit-identical)")
        sq = model.start(video.to(dtype), audio.to(dtype), text.to(dtype), inputs.sigma,
                         text_embed=shared)
        for n, i in enumerate(run):
            block = model.load_block(i, dtype)
            for k, v in _backends(block).items():
                result.backends[k] = result.backends.get(k, 0) + v
            with torch.no_grad():
                sq.x = block(sq.x, sq.cond)
            del block
            model.release_block(i)
            ref.run_block(sr, i)
            rel, sqnr, cos = error_metrics(sq.x.float().cpu(), sr.x)
            result.drift.append(Drift(i, sqnr, rel, cos))
            if on_block is not None:
                on_block(n + 1, len(run))
        limit = th.limit(formats)
        last = result.drift[-1]
        result.outputs.append(OutputCheck("hidden", last.sqnr_db, last.rel_err, last.cosine,
                                          limit, last.sqnr_db >= limit))
        if result.final_layer_run:
            for name, got, want in zip(("video", "audio"), model.finish(sq), ref.finish(sr)):
                rel, sqnr, cos = error_metrics(got.float().cpu(), want)
                result.outputs.append(OutputCheck(name, sqnr, rel, cos, limit, sqnr >= limit))
        else:
            result.notes.append(f"--depth {len(run)} of {total} blocks: the final layer was "
                                "skipped; only the hidden-state drift is checked")
        if reference is None:
            result.notes.append("reference = the file's own quantized weights in float math (no "
                                "activation quantization): this tests the runtime, not the "
                                "weights; pass --reference to compare with the original")
    return result


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
