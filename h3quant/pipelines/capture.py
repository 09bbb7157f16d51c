"""``capture``: per-linear input statistics of a checkpoint over the user's own inputs.

    result = capture_statistics("h3.safetensors", ["steps/*.safetensors"], "h3.stats")

Each ``--inputs`` value is a file, folder or glob (``inputs_file.expand_inputs``); each file
(``pipelines.inputs_file``: video, audio and text latents, optional
sigma) is one call of the model; the forward runs block by block over all of them
(``calibration.capture``) and the statistics file (``calibration.stats``) is written atomically.
Every input is checked from its header before any work; the output may not name an input.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from h3quant.errors import UsageError
from h3quant.calibration.hidden import remove_empty

from h3quant.pipelines.inputs_file import MAX_INPUTS  # calls per capture (each holds its state)

if TYPE_CHECKING:
    from h3quant.pipelines.capture_tp import TpHooks


@dataclass
class CaptureResult:
    out: str
    checkpoint: str  # header checksum
    blocks: int
    inputs: list[dict]
    rows: int  # rows every layer saw
    widths: dict[str, int]
    forward: str
    seconds: float
    gains: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> basis -> dB
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"out": self.out, "checkpoint": self.checkpoint, "blocks": self.blocks,
                "inputs": self.inputs, "rows_per_layer": self.rows, "forward": self.forward,
                "seconds": round(self.seconds, 3), "predicted_gain_db": self.gains,
                "warnings": self.warnings}


def sha256_file(path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_inputs(paths, sigma: float) -> list[dict]:
    """Each inputs file's name, checksum, sigma and recorded seed (checked from its header)."""
    from h3quant.formats.container.reader import SafetensorsFile
    from h3quant.pipelines.inputs_file import load_sigma, read_header

    if not paths:
        raise UsageError("capture needs at least one --inputs file")
    if len(paths) > MAX_INPUTS:
        raise UsageError(f"{len(paths)} --inputs files; the limit is {MAX_INPUTS}")
    out = []
    for p in paths:
        dims = read_header(p)
        own = load_sigma(p)
        with SafetensorsFile(p, mmap=False) as fh:
            seed = fh.metadata.get("seed")
        item = {"file": os.path.basename(p), "sha256": sha256_file(p),
                "sigma": own if own is not None else sigma, **dims}
        if seed is not None:
            item["seed"] = seed
        out.append(item)
    return out


def capture_statistics(ckpt: str | os.PathLike, inputs, out: str | os.PathLike, *,
                       sigma: float = 0.6, device: str = "cpu", through=None,
                       overwrite: bool = False, predict: bool = True, group_size: int = 256,
                       memory_budget: int | None = None, progress: bool = False,
                       log=None, tp: int | None = None,
                       tp_timeout_s: float | None = None,
                       tp_hooks: TpHooks | None = None) -> CaptureResult | None:
    """Capture the statistics of ``ckpt``'s DiT block linears over ``inputs`` into ``out``.

    ``through``: run the forward on this checkpoint instead (an already-quantized conversion of
    ``ckpt``, on the device's runtime path): each block's statistics then come from the inputs
    the quantized blocks before it produce. ``predict``: the predicted gain of calibrated
    rounding per layer (plain basis and ConvRot ``group_size``), from the statistics alone.
    ``memory_budget``: bytes for the calls' hidden states (None: half the memory available);
    beyond it they are spilled to ``OUT.h3q-spill`` (``calibration.hidden``), removed at the end
    however the run ends. ``tp``: run the forward tensor-parallel over ``tp`` ranks
    (``pipelines.capture_tp``; a float checkpoint, no ``through``), spawned here or torchrun's
    group, each on its own device of ``device``'s kind (cpu: gloo, cuda: nccl, npu: hccl; the
    checks and messages of ``verify --tp``): each rank holds its shard of every block and the
    budget is each rank's; rank 0 writes the statistics. Under torchrun every rank calls this
    function and only rank 0 gets the result (the others None). ``tp_timeout_s``: the bound of
    the rendezvous and of every collective; ``tp_hooks``: tests and simulations only."""
    from tqdm import tqdm

    from h3quant.calibration.capture import capture, layer_widths
    from h3quant.calibration.hidden import HiddenStates, call_bytes, default_budget
    from h3quant.calibration.fingerprint import checkpoint_fingerprint
    from h3quant.calibration.stats import VERSION
    from h3quant.formats.container.atomic import Outputs
    from h3quant.pipelines.inputs_file import load_tensors
    from h3quant.sources import input_paths, open_source
    from h3quant.runtime.model.model import H3Model

    log = log or (lambda msg: None)
    if not 0.0 < sigma <= 1.0:
        raise UsageError(f"--sigma must be in (0, 1], got {sigma}")
    t0 = time.perf_counter()
    launch = None
    if tp is not None:  # N, torchrun, the device, its backend and count: before any file
        from h3quant.runtime.tp.launch import plan_launch

        launch = plan_launch(tp, device,
                             backend=tp_hooks.dist_backend if tp_hooks else None)
    lead = launch is None or launch.rank == 0  # the process that writes OUT and reports
    from h3quant.pipelines.inputs_file import expand_inputs

    inputs = expand_inputs(inputs)
    described = describe_inputs([str(p) for p in inputs], sigma)
    fp = checkpoint_fingerprint(ckpt)
    with open_source(ckpt) as c:  # a GGUF file is read in place, like a safetensors one
        read = input_paths(c, Path(ckpt))
    if through is not None:
        with open_source(through) as c:
            read += input_paths(c, Path(through))
    read += [Path(p) for p in inputs]
    with H3Model.open(ckpt, "cpu", linear="reference") as own:
        widths = layer_widths(own)
        blocks = len(own.blocks)
        hidden = own.hidden
        if tp is not None:
            check_tp(through, own)
    store = HiddenStates(spill_dir(out), call_bytes(described, hidden),
                         default_budget() if memory_budget is None else memory_budget)
    if lead:
        log(store.summary())
    if launch is not None and lead:
        log(f"tensor parallel: {tp} {launch.kind} rank(s), "
            f"{'torchrun' if launch.torchrun else 'spawned here'}; rank 0 writes {out}")
    forward = "float" if through is None else checkpoint_fingerprint(through)
    # with --tp the ranks run the forward on their own devices; here only the inputs are read
    with Outputs(inputs=read, overwrite=overwrite, log=log) as outs, \
            H3Model.open(through or ckpt, device if tp is None else "cpu",
                         linear="runtime" if through is not None else "reference") as model:
        if through is not None and layer_widths(model) != widths:
            raise UsageError("--through: its blocks do not have the checkpoint's linears and "
                             "widths", path=through)
        # torchrun's other ranks write nothing, but refuse the OUT rank 0 refuses
        staged = outs.add(out, what="statistics") if lead else outs.check(out, what="statistics")

        def calls():
            for p, item in zip(inputs, described):
                v, a, t = load_tensors(p, model.video_channels, model.audio_channels,
                                       model.text_dim)
                yield v, a, t, float(item["sigma"])

        meta = {"version": VERSION, "checkpoint": fp, "blocks": blocks, "inputs": described,
                "forward": forward}
        bar = tqdm(total=blocks * len(described), unit="call", desc="capture", leave=False,
                   disable=not progress or tp is not None)  # the ranks: no bar
        store.clean()  # a killed run's leftovers
        try:
            if tp is None:
                rows = capture(model, calls(), staged, meta, widths,
                               on_call=lambda: bar.update(1), store=store)
            else:
                from h3quant.pipelines.capture_tp import capture_tp

                assert launch is not None
                got = capture_tp(launch, str(ckpt), list(calls()), staged if lead else None,
                                 meta, widths, store, tp_timeout_s, tp_hooks)
                rows = got or {}
        finally:
            bar.close()
            store.close()
            remove_empty(store.folder)
    if not lead:  # a torchrun rank other than 0: rank 0 reports
        return None
    result = CaptureResult(str(out), fp, blocks, described, next(iter(rows.values())), widths,
                           forward, time.perf_counter() - t0)
    small = sorted(k for k, w in widths.items() if result.rows < w)
    if small:
        result.warnings.append(
            f"{len(small)} layer(s) saw fewer rows ({result.rows}) than their input width K "
            f"(e.g. {small[0]}, K={widths[small[0]]}): their Hessian is singular and 'convert "
            "--calibration' rounds them to nearest; record more steps or larger latents")
    if predict:
        result.gains = predicted_gains(out, group_size, progress=progress)
    return result


def check_tp(through, model) -> None:
    """``--tp``'s supported inputs: a float checkpoint, no ``--through`` (the devices and the
    launch are checked by ``runtime.tp.launch.plan_launch``)."""
    if through is not None:
        raise UsageError("--tp with --through is not supported: the tensor-parallel capture "
                         "runs the float checkpoint's own forward")
    quantized = sorted(model.scan.quantized)
    if quantized:
        raise UsageError("--tp needs a float checkpoint (its blocks run as sharded float "
                         f"linears); {quantized[0]} is quantized", path=model.path)


def spill_dir(out) -> Path:
    """Where ``capture`` spills the hidden states beyond its memory budget."""
    return Path(str(out).rstrip("/\\") + ".h3q-spill")


def predicted_gains(stats_path, group_size: int = 256, *, progress: bool = False
                    ) -> dict[str, dict[str, float]]:
    """Predicted gain (dB) of calibrated rounding per layer, in the plain basis (int8) and the
    ConvRot basis (int8-convrot, w4a8), from the statistics alone (``calibration.gptq``)."""
    from tqdm import tqdm

    from h3quant.calibration.stats import Statistics

    gains: dict[str, dict[str, float]] = {}
    with Statistics(stats_path) as st:
        order = sorted(st.layers, key=lambda k: (int(k.split(".")[1]), k))
        for key in tqdm(order, desc="predict", leave=False, disable=not progress):
            lay = st.layers[key]
            g = {"plain": round(lay.predicted_gain_db(False), 2)}
            if lay.k % group_size == 0:
                g[f"convrot{group_size}"] = round(lay.predicted_gain_db(True, group_size), 2)
            gains[key] = g
            lay.release()
    return gains


__all__ = ["CaptureResult", "capture_statistics", "describe_inputs", "predicted_gains",
           "spill_dir"]
