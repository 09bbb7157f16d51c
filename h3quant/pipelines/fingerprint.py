"""What a saved result was measured on, so it is never applied to another file.

A sensitivity pass (``plan --json``, reused with ``plan --from``), calibration statistics or a
card records ``measured_on``: the fingerprint of the checkpoint it came from and of the inputs
it ran on. Before a saved result is used, ``check`` compares it with the fingerprint of the
file given now and refuses (``UsageError``, exit 2) any difference, naming it.

The checkpoint fingerprint is cheap and bounded: a sha256 over every tensor's name, dtype and
shape and the metadata (the header, in a canonical order, for every shard), the block count,
and a sha256 over a fixed sample of the data (16 windows of 64 KiB spread over each file's data;
at most 1 MiB read per file), so two files with the same shapes but other weights differ too.

Usage by any command that saves or reuses a result::

    from h3quant.pipelines.fingerprint import checkpoint_fingerprint, check, inputs_fingerprint
    saved["measured_on"] = {"checkpoint": checkpoint_fingerprint(src),
                            "inputs": inputs_fingerprint(seed=0, file=None, frames=2)}
    ...
    check(saved.get("measured_on"), {"checkpoint": checkpoint_fingerprint(src), ...},
          what="--from pass.json")
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from h3quant.errors import UsageError

KIND = "h3quant-fingerprint-1"
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 64 << 10


def _sample(path: Path, begin: int, end: int, h) -> None:
    span = max(0, end - begin)
    with open(path, "rb") as fh:
        if span <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            fh.seek(begin)
            h.update(fh.read(span))
            return
        step = (span - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
        for i in range(SAMPLE_WINDOWS):
            fh.seek(begin + i * step)
            h.update(fh.read(SAMPLE_BYTES))


def checkpoint_fingerprint(path: str | os.PathLike, *, mmap: bool = True) -> dict:
    """``{"kind", "header_sha256", "data_sample_sha256", "blocks", "tensors"}`` of a checkpoint
    (a file, an index or a directory of shards)."""
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.h3.topology import detect

    with Checkpoint(path, mmap=mmap) as ck:
        infos = ck.tensors
        header = {n: [infos[n].dtype, list(infos[n].shape)] for n in sorted(infos)}
        body = json.dumps({"tensors": header, "metadata": ck.metadata}, sort_keys=True)
        data = hashlib.sha256()
        for sf in ck.files:
            ends = [t.end for t in sf.tensors.values()]
            begins = [t.begin for t in sf.tensors.values()]
            if ends:
                _sample(Path(sf.path), min(begins), max(ends), data)
        det = detect(infos)
        return {"kind": KIND, "header_sha256": hashlib.sha256(body.encode()).hexdigest(),
                "data_sample_sha256": data.hexdigest(),
                "blocks": det.blocks if det is not None else 0, "tensors": len(infos)}


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inputs_fingerprint(inputs: dict) -> dict:
    """The inputs a result ran on: their sizes and seed, or the checksum of an inputs file."""
    out = {k: inputs[k] for k in sorted(inputs) if k != "file"}
    if inputs.get("file"):
        out["file_sha256"] = file_sha256(inputs["file"])
    return out


_LABELS = {"header_sha256": "the header (tensor names, dtypes, shapes)",
           "data_sample_sha256": "the weights (a sample of the data)",
           "blocks": "the block count", "tensors": "the tensor count"}


def check(recorded, actual: dict, *, what: str) -> None:
    """Refuse a saved result whose ``measured_on`` differs from ``actual`` (``UsageError``)."""
    if not isinstance(recorded, dict):
        raise UsageError(f"{what}: it does not record what it was measured on (saved by an "
                         "older h3quant?); measure again")
    for part, now in actual.items():
        then = recorded.get(part)
        if not isinstance(then, dict):
            raise UsageError(f"{what}: it does not record the {part} it was measured on "
                             "(saved by an older h3quant?); measure again")
        diff = [k for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)]
        if diff:
            k = diff[0]
            label = _LABELS.get(k, k)
            shown = (f" ({then.get(k)} there, {now.get(k)} here)"
                     if not str(k).endswith("sha256") else "")
            raise UsageError(f"{what}: it was measured on another {part}: {label} differs"
                             f"{shown}; a saved result belongs to the file and inputs it was "
                             "measured on: measure this one")
