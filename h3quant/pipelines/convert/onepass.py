"""``convert --calibrate-on INPUTS``: calibrated conversion in one pass, block by block, resumable.

    report = convert(src, dst, ConvertOptions(target="w4a8", calibrate_on=("steps",)))

No statistics file: for each DiT block ``b`` in order,

1. **capture**: block ``b`` runs in float math on every call's hidden state while its four
   linears record their input statistics (``calibration.capture.Recording``, exactly as
   ``h3quant capture`` records them); the statistics go to a scratch file in the work folder;
2. **factorisation**: block ``b``'s layers are encoded with them, through convert's own layer
   pass (error feedback, AWQ folds; the report's entries), into ``block_{b}.safetensors`` in
   the work folder; then the statistics are deleted: there is never more than one block's;
3. **feedback**: the calls' hidden states move on through block ``b``: by default the float
   block's outputs (the statistics are then those of ``h3quant capture``, and so are the
   bytes); ``feedback="quantized"`` runs them through the block as just quantized (its linears
   on the runtime path, as the device runs the file), so block ``b+1`` is measured on what it
   will really see (slower; no better on the synthetic measurement, docs/calibration.md);
4. **write**: every call's hidden state (a file per call and block, the previous block's
   removed after) and the state file are saved, each atomically, to the work folder.

The hidden states are held by ``calibration.hidden.HiddenStates`` within
``options.memory_budget``: beyond it, calls are spilled to the work folder as they are computed
and read back per call. With ``options.smooth == "auto"`` block ``b``'s smoothing is searched on
block ``b``'s statistics after its capture and folded into a view of the input before its
layers are encoded (``convert.smoothing``); the factors are kept in the block file. The capture
(and a quantized feedback) run on ``options.device``; the encoding on the CPU.

The work folder is ``OUT.h3q-onepass``. Its ``state.json`` holds the checksums of the
checkpoint (header), of every input file and of the options, and the checksum of each finished
block's file and of the saved hidden states. A run that was interrupted (even by SIGKILL)
starts again after the last finished block; changed inputs or options are refused, naming
what changed. When every block is done, the output is written as convert writes it, the
block linears' tensors copied from the block files, and the work folder is removed. The output
bytes equal those of an uninterrupted run.

Progress goes to ``log`` per block and per phase with an ETA from the blocks measured; the
report's ``onepass`` entry has the per-block times, the work folder's size at its peak (while
the block's statistics are there) and the process's peak resident set so far.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from h3quant.errors import UsageError
from h3quant.h3 import layouts
from h3quant.pipelines.capture import sha256_file

WORK_SUFFIX = ".h3q-onepass"
STATE_VERSION = 2
PHASES = ("capture", "factorisation", "feedback", "write")
ENTRIES_KEY = "h3quant.onepass.entries"
SMOOTHING_KEY = "h3quant.onepass.smoothing"  # the block's smoothing search (report entries)
SMOOTH_PREFIX = "smooth/"  # a block file's smoothing factors: "smooth/" + layer name
# options that change no output byte and no report entry: a resumed run may change them
_FREE = ("workers", "mmap", "overwrite", "calibrate_on", "calibration", "calibration_heldout",
         "naming", "loras", "lora_skip_unmatched", "lora_warn", "lora_promote", "memory_budget")


def work_dir(dst) -> Path:
    return Path(str(dst).rstrip("/\\") + WORK_SUFFIX)


def _options_key(options) -> dict:
    d = options.to_dict()
    return {k: v for k, v in sorted(d.items()) if k not in _FREE}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, sort_keys=True, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _check_resume(work: Path, key: dict) -> dict | None:
    """The saved state of an interrupted run with the same key (None when there is none);
    UsageError naming what changed, or which saved file is damaged."""
    path = work / "state.json"
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--calibrate-on: the saved state of an interrupted run is unreadable "
                         f"({exc}); remove the folder to start again", path=work) from None
    old = state.get("key", {})
    hint = f"; remove {work} to start again"
    if old.get("version") != key["version"]:
        raise UsageError("--calibrate-on: the interrupted run was made by another version"
                         + hint, path=work)
    if old.get("checkpoint") != key["checkpoint"]:
        raise UsageError("--calibrate-on: the interrupted run was made on another checkpoint "
                         "(its header checksum differs)" + hint, path=work)
    was = {f: s for f, s in old.get("inputs", [])}
    now = {f: s for f, s in key["inputs"]}
    if [f for f, _ in old.get("inputs", [])] != [f for f, _ in key["inputs"]]:
        gone = sorted(set(was) - set(now))
        new = sorted(set(now) - set(was))
        what = (f"{len(gone)} input(s) gone ({', '.join(gone[:3])})" if gone else
                f"{len(new)} new input(s) ({', '.join(new[:3])})" if new else "the inputs' order")
        raise UsageError(f"--calibrate-on: the inputs changed since the interrupted run: {what}"
                         + hint, path=work)
    changed = [f for f in now if was[f] != now[f]]
    if changed:
        raise UsageError(f"--calibrate-on: input {changed[0]} changed since the interrupted run "
                         "(its sha256 differs)" + hint, path=work)
    if old.get("options") != key["options"]:
        diff = sorted(k for k in set(old.get("options", {})) | set(key["options"])
                      if old.get("options", {}).get(k) != key["options"].get(k))
        raise UsageError(f"--calibrate-on: the options changed since the interrupted run: "
                         f"{', '.join(diff)}" + hint, path=work)
    for item in state.get("blocks", []):
        f = work / item["file"]
        if not f.exists() or sha256_file(f) != item["sha256"]:
            raise UsageError(f"--calibrate-on: the saved block file {item['file']} is missing or "
                             "damaged" + hint, path=work)
    if state.get("blocks"):
        for name, sha in state.get("hidden") or [["(none)", ""]]:
            f = work / str(name)
            if not f.is_file() or sha256_file(f) != sha:
                raise UsageError("--calibrate-on: the saved hidden states are missing or damaged"
                                 + hint, path=work)
    return state


class BlockFiles:
    """The finished blocks' layer outputs, copied into the output by convert's layer pass."""

    def __init__(self, work: Path, blocks: list[dict]):
        from h3quant.formats.container.reader import SafetensorsFile

        self._files = []
        self._where: dict[str, SafetensorsFile] = {}
        self.entries: dict[str, dict] = {}
        self.smoothed: dict = {}  # layer -> its smoothing factors (smoothing.fold_found)
        self.smoothing: dict[str, dict] = {}  # layer -> the search's report entry
        for item in blocks:
            fh = SafetensorsFile(work / item["file"], mmap=False)
            self._files.append(fh)
            entries = json.loads(fh.metadata.get(ENTRIES_KEY, "{}"))
            self.entries.update(entries)
            self.smoothing.update(json.loads(fh.metadata.get(SMOOTHING_KEY, "{}")))
            for name, info in fh.tensors.items():
                if name.startswith(SMOOTH_PREFIX):
                    self.smoothed[name[len(SMOOTH_PREFIX):]] = fh.read(info).clone()
                else:
                    self._where[name] = fh

    def __contains__(self, layer: str) -> bool:
        return layer in self.entries

    def write(self, lp, sinks) -> dict:
        """Write layer ``lp``'s encoded tensors to ``sinks``; its report entry."""
        prefix = lp.name + "."
        for name, fh in self._where.items():
            if name.startswith(prefix) and name[len(prefix):].count(".") == 0:
                info = fh.tensors[name]
                sinks.write(name, 0, fh.read_bytes(info, 0, info.nbytes))
        return self.entries[lp.name]

    def close(self) -> None:
        for fh in self._files:
            fh.close()


def _block_of(name: str) -> int | None:
    from h3quant.calibration.stats import layer_key

    key = layer_key(name)
    return None if key is None else int(key.split(".")[1])


class _Bar:
    def update(self, n) -> None:
        pass


def _fmt(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def onepass_convert(src, dst, options, *, progress: bool = False, log=None, report_path=None,
                    files=None, convert_fn=None, stop_after: int | None = None):
    """Calibrate and convert ``src`` into ``dst`` in one pass over ``options.calibrate_on``
    (see the module docstring); the ``ConvertReport``. ``convert_fn``: convert itself, which
    writes the output from the finished blocks. ``stop_after``: return None after that many
    blocks were finished in this call (tests of the resume)."""
    import torch

    from h3quant.calibration.capture import layer_widths, sample_indices
    from h3quant.calibration.fingerprint import checkpoint_fingerprint
    from h3quant.calibration.hidden import HiddenStates, call_bytes, default_budget
    from h3quant.calibration.stats import VERSION
    from h3quant.sources import adopt_mapping, open_source
    from h3quant.pipelines.capture import describe_inputs
    from h3quant.pipelines.convert.plan import build_plan
    from h3quant.pipelines.inputs_file import expand_inputs, load_tensors
    from h3quant.runtime.model.model import H3Model

    log = log or (lambda msg: None)
    src, dst = Path(src), Path(dst)
    inputs = expand_inputs(options.calibrate_on, option="--calibrate-on")
    if files is not None:
        for p in inputs:
            files.read(p, "--calibrate-on input")
        files.check(overwrite=options.overwrite)
    if options.loras or options.naming not in ("auto", layouts.TARGET):
        raise UsageError("--calibrate-on takes a ComfyUI single-file float checkpoint without "
                         "--lora; run 'h3quant capture', then convert --calibration")
    described = describe_inputs([str(p) for p in inputs], 0.6)  # capture's default sigma
    fp = checkpoint_fingerprint(src)
    key = {"version": STATE_VERSION, "checkpoint": fp,
           "inputs": [[d["file"], d["sha256"]] for d in described],
           "options": _options_key(options)}
    work = work_dir(dst)
    t_start = time.perf_counter()
    with open_source(src, mmap=options.mmap) as ckpt, \
            H3Model.open(src, options.device, linear="reference") as model:
        det, mapping = adopt_mapping(ckpt, options.naming)
        if not mapping.trivial:
            raise UsageError("--calibrate-on takes ComfyUI's single file; convert this "
                             f"{det.naming} checkpoint to it first (convert --to bf16)", path=src)
        plan = build_plan(ckpt, src, dst, options)
        widths = layer_widths(model)
        blocks = list(model.blocks)
        store = HiddenStates(work, call_bytes(described, model.hidden),
                             default_budget() if options.memory_budget is None
                             else options.memory_budget, keep_all=True)
        state = _check_resume(work, key)
        if state is None:
            if work.exists():
                shutil.rmtree(work)  # a run killed before its first block: nothing to keep
            work.mkdir(parents=True)
            state = {"key": key, "blocks": [], "times": []}
            _write_json(work / "state.json", state)
        else:
            log(f"resuming {work}: {len(state['blocks'])} block(s) already done")
        done = {b["block"] for b in state["blocks"]}
        log(store.summary())
        gen = len(state["blocks"])  # the saved hidden states: after this many blocks
        store.clean(keep=lambda g: bool(done) and g == gen)  # a killed run's leftovers
        states, dtype = [], torch.float32
        with torch.no_grad():
            for i, (p, item) in enumerate(zip(inputs, described)):
                v, a, tx = load_tensors(p, model.video_channels, model.audio_channels,
                                        model.text_dim)
                st = model.start(v, a, tx, float(item["sigma"]))
                if not done:  # one call at a time: a spilled one goes to disk at once
                    store.put(0, i, st.x)
                dtype, st.x = st.x.dtype, st.x.new_empty(0)  # the store holds it
                states.append(st)
        if done:
            store.adopt(gen, model.tdev, dtype)
        seq = sum(int(st.layout.rows) for st in states)
        keep = sample_indices(seq)
        times: list[dict] = list(state.get("times", []))
        finished_now = 0
        try:
            for b in blocks:
                if b in done:
                    continue
                t = _run_block(b, gen, model=model, plan=plan, ckpt=ckpt, mapping=mapping,
                               src=src, work=work, log=log,
                               options=options, states=states, store=store, dtype=dtype,
                               widths=widths, keep=keep, meta={
                                   "version": VERSION, "checkpoint": fp, "blocks": len(blocks),
                                   "inputs": described, "forward": options.feedback,
                                   "sample_rows": len(keep)})
                # write: every call's state file and the state file, atomically
                t3 = time.perf_counter()
                saved = store.persist(gen + 1)  # a kill at any point leaves the state file
                part = work / f"block_{b:03d}.safetensors"  # naming a complete, checked set
                state["blocks"].append({"block": b, "file": part.name,
                                        "sha256": sha256_file(part)})
                state["hidden"] = [[f.name, sha256_file(f)] for f in saved]
                t["write"] = time.perf_counter() - t3
                t["total"] = time.perf_counter() - t["start"]
                del t["start"]
                t["peak_rss_bytes"] = _peak_rss()
                times.append({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in t.items()})
                state["times"] = times
                _write_json(work / "state.json", state)
                store.drop(gen)
                gen += 1
                finished_now += 1
                left = len(blocks) - len(state["blocks"])
                mean = sum(x["total"] for x in times) / len(times)
                log(f"block {b + 1}/{len(blocks)}: "
                    + ", ".join(f"{p} {t[p]:.1f} s" for p in PHASES)
                    + f"; ETA {_fmt(mean * left)} for {left} block(s)")
                if stop_after is not None and finished_now >= stop_after:
                    return None
        except BaseException:  # Ctrl-C, SIGTERM, an error: the unfinished block's states go;
            store.clean(keep=lambda g: g == gen)  # the last finished one's stay, to resume
            (work / "stats.safetensors").unlink(missing_ok=True)
            raise
    # 5. the output, with the block linears copied from the block files
    parts = BlockFiles(work, state["blocks"])
    try:
        t4 = time.perf_counter()
        report = convert_fn(src, dst, options, progress=progress, log=log,
                            report_path=report_path, files=files, precomputed=parts)
    finally:
        parts.close()
    report.extra["onepass"] = {"feedback": options.feedback, "inputs": len(inputs),
                               "blocks": times, "assemble_s": round(time.perf_counter() - t4, 3),
                               "this_run_s": round(time.perf_counter() - t_start, 3)}
    shutil.rmtree(work, ignore_errors=True)
    return report


def _run_block(b: int, gen: int, *, model, plan, ckpt, mapping, src, work: Path, log, options,
               states, store, dtype, widths, keep, meta) -> dict:
    """Block ``b``'s capture, factorisation and feedback (the module docstring's phases 1-3),
    the calls' states read from ``store`` after ``gen`` blocks and put back after ``gen + 1``;
    the phases' times."""
    import torch

    from h3quant.calibration.capture import BlockWriter, recording_block, stats_layout, \
        write_recordings
    from h3quant.calibration.stats import META_KEY

    t: dict = {"block": b, "start": time.perf_counter()}
    dev = model.tdev
    # 1. capture: the float block on every call, its linears recording
    with torch.no_grad():
        block, rec = recording_block(model, b, dtype, widths, keep)
        for i, st in enumerate(states):
            out = block(store.get(gen, i, dev, dtype), st.cond)
            if options.feedback == "float":  # the float outputs are the next states
                store.put(gen + 1, i, out)
            del out  # else the quantized block gives them (feedback, below)
        del block
        model.release_block(b)
    mine = {k: widths[k] for k in rec}
    seq = next(iter(rec.values())).rows
    meta = {**meta, "rows": {k: seq for k in mine}}
    stats_path = work / "stats.safetensors"
    writer = BlockWriter(stats_path, stats_layout(
        mine, {META_KEY: json.dumps(meta, sort_keys=True)}, len(keep), packed=True))
    try:
        write_recordings(writer, rec)
    finally:
        writer.close(True)
    del rec
    t["capture"] = time.perf_counter() - t["start"]
    # 2. factorisation: the block's layers encoded with them
    t1 = time.perf_counter()
    part = work / f"block_{b:03d}.safetensors"
    found: dict = {}
    report: dict = {}
    source = ckpt
    if options.smooth != "off":  # block b's factors, from block b's statistics, folded exactly
        from h3quant.calibration.stats import Statistics  # as convert --calibration does
        from h3quant.pipelines.convert.smoothing import fold_into, search
        from h3quant.pipelines.convert.view import source_view

        source, _ = source_view(ckpt, mapping, options)
        with Statistics(stats_path) as st:
            found, report = search(source, st, options, log)
        fold_into(source, found)
        from h3quant.pipelines.convert.plan import build_plan

        plan = build_plan(source, src, plan.dst, options)  # the view's own offsets
    _encode_block(plan, source, b, stats_path, src, part, options.workers, found, report)
    t["work_bytes"] = _folder_bytes(work)  # its peak: the block's statistics still there
    stats_path.unlink()
    t["factorisation"] = time.perf_counter() - t1
    # 3. feedback: the states move on through the quantized (or the float) block
    t2 = time.perf_counter()
    with torch.no_grad():
        if options.feedback != "float":
            qblock = _quantized_block(model, b, part, dtype)
            for i, st in enumerate(states):
                store.put(gen + 1, i, qblock(store.get(gen, i, dev, dtype), st.cond))
            del qblock
    t["feedback"] = time.perf_counter() - t2
    return t


class _MemorySink:
    """The layer pass's sink, keeping each output tensor's bytes (one block's layers)."""

    def __init__(self, entries):
        self.bufs = {e.name: bytearray(e.nbytes) for e in entries}

    def write(self, name: str, start: int, data) -> None:
        mv = memoryview(data).cast("B")
        buf = self.bufs[name]
        if start < 0 or start + mv.nbytes > len(buf):
            raise ValueError(f"{name}: bytes [{start}, {start + mv.nbytes}) outside {len(buf)}")
        buf[start:start + mv.nbytes] = mv

    def write_tensor(self, name: str, tensor, start: int = 0) -> None:
        from h3quant.formats.container.writer import tensor_bytes

        if tensor.numel():
            self.write(name, start, tensor_bytes(tensor.contiguous()))

    def write_behind(self, tensors) -> None:
        for name, tensor in tensors.items():
            self.write_tensor(name, tensor)

    def wait_behind(self) -> None:
        pass


def _encode_block(plan, ckpt, b: int, stats_path, src, part, workers: int, found: dict,
                  smoothing: dict) -> None:
    """Block ``b``'s planned layers through convert's layer pass, into the file ``part``
    (``ckpt``: the input, or a view of it with the block's smoothing ``found`` folded in;
    the factors and the search's ``smoothing`` report are kept in the file too)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    import torch

    from h3quant.formats.container.writer import Entry, plan_layout, tensor_bytes
    from h3quant.pipelines.convert.calibrated import Calibration
    from h3quant.pipelines.convert.folds import ChannelScales
    from h3quant.pipelines.convert.io import OffsetWriter, Reader, by_input_offset
    from h3quant.pipelines.convert.result import LayerFailures
    from h3quant.pipelines.convert.run import CheckedRows, run_layer

    layers = [lp for lp in by_input_offset(plan.layers, lambda lp: lp.weight)
              if _block_of(lp.name) == b and lp.action == "convert"]
    names = {lp.name for lp in layers}
    copied = {c.out for lp in layers for c in lp.copies}
    entries, metadata = [], None
    for sp in plan.shards.values():
        size = int.from_bytes(sp.planned_layout.header[:8], "little")
        meta = json.loads(sp.planned_layout.header[8:8 + size].decode("utf-8")).get("__metadata__")
        metadata = metadata or meta
        entries += [e for e in sp.entries
                    if e.name.rpartition(".")[0] in names and e.name not in copied]
    results: dict[str, dict] = {}
    failures: list[dict] = []
    reader = Reader(ckpt)
    sink = _MemorySink(entries)
    plan.calibration = Calibration(str(stats_path), src, smoothed=found or None)
    pool = ThreadPoolExecutor(workers) if workers > 1 else None
    threads = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        scales = (ChannelScales(plan, lambda lp: CheckedRows(lp, reader))
                  if plan.folds else None)
        for lp in layers:
            run_layer(lp, plan=plan, reader=reader, sinks=sink, bar=_Bar(), pool=pool,
                      results=results, failures=failures, scales=scales)
        for entry in results.values():
            if isinstance(entry.get("metrics"), Future):
                entry["metrics"] = entry["metrics"].result()
        if failures:
            raise LayerFailures(f"{len(failures)} layer(s) failed to convert; nothing written: "
                                + "; ".join(f"{f['name']}: {f['error']}" for f in failures))
        factors = {SMOOTH_PREFIX + name: s.to(torch.float32).contiguous()
                   for name, s in found.items()}
        entries += [Entry(name, "F32", tuple(s.shape)) for name, s in factors.items()]
        layout = plan_layout(entries, {**(metadata or {}),
                                       ENTRIES_KEY: json.dumps(results, sort_keys=True),
                                       SMOOTHING_KEY: json.dumps(smoothing, sort_keys=True)})
        with OffsetWriter(part, layout) as w:
            for name, buf in sink.bufs.items():
                if buf:
                    w.write(name, 0, buf)
            for name, s in factors.items():
                w.write(name, 0, tensor_bytes(s))
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        plan.calibration.close()
        plan.calibration = None
        torch.set_num_threads(threads)


def _quantized_block(model, b: int, part, dtype):
    """Block ``b`` with its linears read from ``part`` on the runtime path (the rest float)."""
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.layers import scan_checkpoint
    from h3quant.runtime.loader import load_layer, load_prefix
    from h3quant.runtime.model.block import build_block, quantized_linear, reference_linear

    prefix = f"{model.prefix}blocks.{b}"
    loaded = load_prefix(model.ckpt, model.scan, prefix, b)
    with Checkpoint(part) as pc:
        scan = scan_checkpoint(pc)
        quantized = set()
        for name, layer in scan.layers.items():
            if name.startswith(prefix + ".") and layer.weight is not None:
                local = name[len(prefix) + 1:]
                loaded.layers[local] = load_layer(pc, layer)
                quantized.add(local)

    def make(lay):
        if lay.is_quantized:
            return quantized_linear(lay, device=model.device, compute_dtype=dtype)
        return reference_linear(lay, device=model.tdev)

    return build_block(loaded, make, device=model.tdev)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _peak_rss() -> int:
    """The process's peak resident set so far, in bytes (0 where the platform does not say)."""
    from h3quant.formats.container.platform import max_rss_bytes

    return max_rss_bytes() or 0


__all__ = ["PHASES", "WORK_SUFFIX", "BlockFiles", "onepass_convert", "work_dir"]
