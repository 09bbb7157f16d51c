"""Capture: the streamed H3 forward, block by block, recording every DiT linear's inputs.

    with H3Model.open(ckpt, "cpu", linear="reference") as model:
        capture(model, calls, out_path, meta, progress=bar.update)

``calls`` are the model inputs (video, audio, text, sigma) of the user's sampler steps. The run is
block-major: every call is started (embeddings, text refiner, conditioning), then block 0 runs
on every call's hidden state while its four linears accumulate ``H = X^T X`` (fp32) and
``sum |x|`` and ``max |x|`` per input channel over all the rows they see (text, audio and video
rows alike), and keep a fixed sample of whole rows (``SAMPLE_ROWS`` evenly spaced over the
calls: what smoothing needs to model per-token activation rounding); block 0's statistics
are written to the output and dropped, then block 1 runs, and so on. Memory holds one block's
statistics (fqkv, out_proj, fc1, fc2: ``4 * sum K^2`` bytes, about 1.2 GB at H3's full width)
plus the calls' hidden states (rows x hidden x 4 bytes each; within a memory budget, the rest
on disk: ``calibration.hidden``), never the whole model's.

Where it runs: the forward and ``H``'s float32 accumulation run on the model's device (CPU,
CUDA, MPS, NPU: fp32 matrix products, TF32 left off); ``sum |x|`` accumulates in float64 on
the device, or on the host from each call's float32 sums where the device has no float64 (MPS);
``max |x|`` is float32; the sampled rows go to the host as they are seen. The statistics are
written from the host.

The forward runs in float math: a float checkpoint's own weights (``linear="reference"``), so the
statistics are those of the float model's activations. A model built on another checkpoint (an
already-quantized conversion of the same weights, ``linear="runtime"``) gives each block the
inputs the quantized blocks before it produce instead.
"""

from __future__ import annotations

import torch
from torch import nn

import os

from h3quant import device_kinds
from h3quant.calibration.stats import LINEARS
from h3quant.formats import registry

from h3quant.formats.container.writer import Entry, plan_layout, tensor_bytes
from h3quant.runtime.model.block import swiglu


class BlockWriter:
    """Writes the planned tensors at their offsets in any order (a block's statistics as it
    completes); the caller stages the path (``formats.container.atomic.Outputs``)."""

    def __init__(self, path, layout):
        self.layout = layout
        self._fh = open(path, "wb")
        self._fh.write(layout.header)
        self._fh.truncate(layout.file_bytes)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        entry, (start, _) = self.layout.entries[name], self.layout.offsets[name]
        if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != torch.float32:
            raise ValueError(f"{name}: {list(tensor.shape)} is not the planned {list(entry.shape)}")
        self._fh.seek(len(self.layout.header) + start)
        self._fh.write(tensor_bytes(tensor.contiguous()))

    def close(self, ok: bool) -> None:
        if ok:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        self._fh.close()


SAMPLE_ROWS = 256  # whole input rows kept per linear (evenly spaced over every call's rows)


def sample_indices(total: int, count: int = SAMPLE_ROWS) -> list[int]:
    """``min(count, total)`` row indices evenly spaced over ``total`` rows (first row 0)."""
    n = min(count, total)
    return [i * total // n for i in range(n)] if n else []


class Recording(nn.Module):
    """A linear that accumulates its inputs' second moment and channel magnitudes (mean and
    max ``|x|``) and keeps the sampled rows ``keep`` (global row indices), then runs."""

    def __init__(self, inner: nn.Module, k: int, device, keep: list[int] | None = None, *,
                 comm=None, record: bool = True):
        super().__init__()
        self.inner = inner
        # tensor parallel: ``comm`` (a row-parallel layer's recorder) all_gathers the ranks'
        # input slices into the whole input, in the original column order; ``record`` False
        # (every rank but 0) only takes part in that gather
        self.comm, self.record = comm, record
        k = k if record else 0
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        # the channel magnitudes' running sum in float64: on the device where it has float64,
        # else on the host, from each call's float32 sums on the device
        wide = device_kinds.kind(torch.device(device).type).float64
        self.abs_sum = torch.zeros(k, dtype=torch.float64, device=device if wide else "cpu")
        self.abs_max = torch.zeros(k, dtype=torch.float32, device=device)
        self.keep = torch.tensor(keep or [], dtype=torch.long)
        self.sample = torch.zeros(len(self.keep), k, dtype=torch.float32)
        self.rows = 0

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        if input_act == "swiglu":
            x = swiglu(x)
        elif input_act is not None:
            return self.inner(x, input_act=input_act)
        full = x
        if self.comm is not None:  # the ranks' slices are contiguous runs of the input's columns
            full = torch.cat(self.comm.all_gather(x.contiguous(), "capture: layer input"), -1)
        if self.record:
            self._accumulate(full)
        return self.inner(x)

    def _accumulate(self, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.h.addmm_(x2.t(), x2)
        if self.abs_sum.device == x2.device:
            self.abs_sum += x2.abs().sum(0, dtype=torch.float64)
        else:
            self.abs_sum += x2.abs().sum(0).cpu().to(torch.float64)
        if x2.shape[0]:
            torch.maximum(self.abs_max, x2.abs().amax(0), out=self.abs_max)
        n = int(x2.shape[0])
        mine = (self.keep >= self.rows) & (self.keep < self.rows + n)
        if bool(mine.any()):
            self.sample[mine] = x2[(self.keep[mine] - self.rows).to(x2.device)].cpu()
        self.rows += n


def layer_widths(model) -> dict[str, int]:
    """``blocks.{i}.{linear}`` -> logical input width K, from the checkpoint header."""
    out = {}
    for i in model.blocks:
        for lin in LINEARS:
            name = f"{model.prefix}blocks.{i}.{lin}"
            layer = model.scan.layers.get(name)
            if layer is None or layer.weight is None:
                from h3quant.errors import VerifyError
                raise VerifyError("layer missing (the H3 forward needs it)", path=model.path,
                                  tensor=name + ".weight")
            out[f"blocks.{i}.{lin}"] = registry.logical_shape(tuple(layer.weight.shape),
                                                              layer.fields)[1]
    return out


def stats_layout(widths: dict[str, int], metadata: dict[str, str], sample_rows: int | None = None,
                 *, packed: bool = False):
    """The statistics file's header, known before any tensor is computed (``sample_rows``:
    the rows sampled per layer; None writes the first version's layout, without the channel
    maxima and the sample; ``packed``: each Hessian as its upper triangle, version 3)."""
    from h3quant.calibration.stats import packed_size

    entries = []
    for key, k in widths.items():
        entries.append(Entry(f"{key}.hessian", "F32", (packed_size(k),) if packed else (k, k)))
        entries.append(Entry(f"{key}.absmean", "F32", (k,)))
        if sample_rows is not None:
            entries.append(Entry(f"{key}.absmax", "F32", (k,)))
            entries.append(Entry(f"{key}.sample", "F32", (sample_rows, k)))
    return plan_layout(entries, metadata)


def capture(model, calls, out_path, meta: dict, widths: dict[str, int], *,
            on_block=None, on_call=None, store=None, comm=None) -> dict[str, int]:
    """Run ``calls`` (tuples ``(video, audio, text, sigma)``) through ``model`` block by block,
    writing the statistics of each block to ``out_path`` as it completes (see the module
    docstring). ``on_block(i)`` after each block, ``on_call()`` after each call in a block
    (progress). ``meta``: the ``h3quant.calibration`` metadata object; ``rows`` is added (every
    linear sees each call's whole packed sequence). ``store``: a ``hidden.HiddenStates`` holding
    the calls' hidden states within a memory budget (None: all in memory). ``comm``: this rank's
    collectives when ``model`` is a tensor-parallel model (``runtime.tp.model.TpH3Model``):
    rank 0 records the whole inputs (row-parallel layers' slices gathered) and writes
    ``out_path``; the other ranks run their shards and write nothing. Returns the rows each
    layer saw (rank 0; every layer 0 on the others)."""
    import json

    from h3quant.calibration.hidden import HiddenStates
    from h3quant.calibration.stats import META_KEY, VERSION

    states, xs, dtype = [], [], torch.float32
    with torch.no_grad():
        for i, (video, audio, text, sigma) in enumerate(calls):
            st = model.start(video, audio, text, sigma)
            if store is None:
                xs.append(st.x)
            else:  # one call's state at a time: a spilled one goes to disk at once
                store.put(0, i, st.x)
            dtype, st.x = st.x.dtype, st.x.new_empty(0)  # the store holds it
            states.append(st)
    if store is None:
        store = HiddenStates(".", [x.nelement() * x.element_size() for x in xs], None)
        for i, x in enumerate(xs):
            store.put(0, i, x)
        del xs
    seq = sum(int(st.layout.rows) for st in states)
    planned = {key: seq for key in widths}
    keep = sample_indices(seq)
    meta = {**meta, "version": VERSION, "rows": planned, "sample_rows": len(keep)}
    layout = stats_layout(widths, {META_KEY: json.dumps(meta, sort_keys=True)}, len(keep),
                          packed=True)
    rows: dict[str, int] = {}
    lead = comm is None or comm.rank == 0
    writer = BlockWriter(out_path, layout) if lead else None
    ok = False
    try:
        _run_blocks(model, states, dtype, store, writer, widths, rows, on_block, on_call,
                    keep, comm)
        ok = True
    finally:
        if writer is not None:
            writer.close(ok)
    if lead and rows != planned:
        raise RuntimeError(f"rows recorded {rows} differ from the planned {planned}")
    return rows


def recording_block(model, index: int, dtype, widths: dict[str, int], keep: list[int],
                    comm=None):
    """Block ``index`` built for the forward with its four linears recording (``Recording``):
    ``(block, {"blocks.{i}.{linear}": Recording})``. ``comm``: see ``capture`` (out_proj and
    fc2 take the rank's slice of their input, qkv_proj and fc1 the whole input)."""
    block = model.load_block(index, dtype)  # float math of its weights (reference), or
    # the device's runtime path (a model opened with linear="runtime")
    rec = {}
    for lin, attr in zip(LINEARS, ("qkv_proj", "out_proj", "fc1", "fc2")):
        key = f"blocks.{index}.{lin}"
        sliced = comm is not None and attr in ("out_proj", "fc2")
        rec[key] = Recording(getattr(block, attr), widths[key], model.tdev, keep,
                             comm=comm if sliced else None,
                             record=comm is None or comm.rank == 0)
        setattr(block, attr, rec[key])
    return block, rec


def write_recordings(writer, rec: dict) -> None:
    """A block's recorded statistics, written at their planned places (the Hessian packed
    where the layout plans it so)."""
    from h3quant.calibration.stats import pack_upper

    for key, r in rec.items():
        h = r.h.cpu()
        packed = len(writer.layout.entries[f"{key}.hessian"].shape) == 1
        writer.write_tensor(f"{key}.hessian", pack_upper(h) if packed else h)
        del h
        writer.write_tensor(f"{key}.absmean", (r.abs_sum / max(r.rows, 1)).to(torch.float32).cpu())
        writer.write_tensor(f"{key}.absmax", r.abs_max.cpu())
        writer.write_tensor(f"{key}.sample", r.sample)


def _run_blocks(model, states, dtype, store, writer, widths, rows, on_block, on_call, keep,
                comm=None) -> None:
    dev = model.tdev
    with torch.no_grad():
        for gen, i in enumerate(model.blocks):
            block, rec = recording_block(model, i, dtype, widths, keep, comm)
            for c, st in enumerate(states):
                store.put(gen + 1, c, block(store.get(gen, c, dev, dtype), st.cond))
                if on_call is not None:
                    on_call()
            store.drop(gen)
            del block
            model.release_block(i)
            if writer is not None:
                write_recordings(writer, rec)
            rows.update({key: r.rows for key, r in rec.items()})
            del rec
            if on_block is not None:
                on_block(i)


__all__ = ["SAMPLE_ROWS", "Recording", "capture", "layer_widths", "recording_block",
           "sample_indices", "stats_layout", "write_recordings"]
