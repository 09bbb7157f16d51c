"""Run a planned conversion: the output opened and the byte-for-byte copies started before torch.

A conversion writes two kinds of tensors. Byte-for-byte ones (most of an H3 file: embeddings,
norms, tables, biases) need no torch at all; the converted layers do. Loading torch takes 1-2 s
on a small machine, so ``run_plan`` first opens every output writer at its planned layout and
starts a thread copying the byte-for-byte tensors (``CopyStream``), and only then imports
``convert.run`` (and torch) to convert the layers while the copies go on. Nothing in this
module, nor anything it imports, loads torch.

Each output tensor is written at the offset ``plan_layout`` gave it (``io.OffsetWriter``), so
the two streams never wait for each other; both read the input in offset order.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from h3quant.formats.container.atomic import fsync_dir
from h3quant.formats.container.signals import deferred_signals
from h3quant.pipelines.convert.io import (
    OffsetWriter,
    Reader,
    Sinks,
    by_input_offset,
    check_finite,
    copy_tensor,
)
from h3quant.pipelines.convert.plan import ConvertPlan
from h3quant.pipelines.convert.result import ConvertReport, build_report

COPY_THREAD = "h3quant-copy"  # name prefix of the copy thread


def shard_of(plan: ConvertPlan) -> dict[str, str]:
    """Output tensor name -> the shard file that holds it."""
    return {e.name: s for s, sp in plan.shards.items() for e in sp.entries}


def copy_all(items, reader, sinks, progress, stop: threading.Event,
             checked: frozenset[str] = frozenset()) -> None:
    for item in items:
        if stop.is_set():
            return
        if item.src.name in checked:  # validate --deep's rule on a float tensor
            check_finite(item.src, reader)
        copy_tensor(item, reader, sinks, progress)


def finite_checked(plan: ConvertPlan) -> frozenset[str]:
    """The copied tensors whose one rule is "finite" (D106): every copy but the tensors of a
    quantized source layer, which its format's own rules judge (a W4A8 codebook is D104, as
    ``validate --deep`` says) in the layer's pass."""
    return frozenset([c.src.name for c in plan.copies]
                     + [c.src.name for lay in plan.layers if lay.src_fields is None
                        for c in lay.copies])


class CopyStream:
    """The output of one run, open, with its byte-for-byte copies running on a thread.

    Context manager. On entry: one ``OffsetWriter`` per output shard (temp files created, sized,
    headers written) and the copy thread started. ``sinks`` / ``reader`` serve the layer
    conversion meanwhile. On a clean exit it waits for the copies (their error is raised here)
    and completes the writers (fsync, rename into the staged output, then the shard index); on
    any exception it stops the copies and removes everything it wrote.
    """

    def __init__(self, plan: ConvertPlan, ckpt, out, progress):
        self.plan, self.ckpt, self.out, self.progress = plan, ckpt, Path(out), progress
        self.reader = Reader(ckpt)
        self.sinks: Sinks | None = None
        self.copying: Future[None] | None = None  # the copy thread's Future
        self._stop = threading.Event()
        self._io: ThreadPoolExecutor | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "CopyStream":
        try:
            writers = open_writers(self.plan, self._stack, self.out)
            self.sinks = Sinks({name: writers[s] for name, s in shard_of(self.plan).items()})
            self._stack.callback(self.sinks.close)  # before the writers complete or abort
            self._io = ThreadPoolExecutor(1, thread_name_prefix=COPY_THREAD)
            self._stack.callback(self._stop_copies)  # runs first on exit: before the writers
            copies = by_input_offset(self.plan.all_copies(), lambda c: c.src)
            self.copying = self._io.submit(copy_all, copies, self.reader, self.sinks,
                                           self.progress, self._stop,
                                           finite_checked(self.plan))
        except BaseException:
            if not self._stack.__exit__(*sys.exc_info()):
                raise
        return self

    def failed(self) -> bool:
        """True once the copy thread has stopped on an error (the run should stop early)."""
        assert self.copying is not None  # started by __enter__
        return self.copying.done() and self.copying.exception() is not None

    def _stop_copies(self) -> None:
        self._stop.set()
        assert self._io is not None  # registered after the pool was made
        self._io.shutdown(wait=True)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                assert self.copying is not None  # a clean __enter__ started it
                self.copying.result()
            except BaseException:
                if not self._stack.__exit__(*sys.exc_info()):
                    raise
                return False
        return bool(self._stack.__exit__(exc_type, exc, tb))


def run_plan(plan: ConvertPlan, ckpt, out, *, progress: bool = True) -> ConvertReport:
    """Execute ``plan`` (from ``build_plan``), writing to ``out`` (the staged path
    ``formats.container.atomic.Outputs`` gave for ``plan.dst``: a file, or an empty directory for sharded
    output), and return the ``ConvertReport``.

    Two streams run at once: the copy thread writes every byte-for-byte tensor (started before
    torch is imported) while the main thread converts the layers (their row chunks on
    ``workers`` threads). A layer whose conversion fails is recorded and the run goes on, so
    every failure is listed (``LayerFailures``); the output is then discarded.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=plan.input_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               file=sys.stderr, disable=not progress, desc="convert", leave=False)
    try:
        with CopyStream(plan, ckpt, out, bar.update) as stream:
            # torch loads here, while the copies run; a signal meanwhile is held until the
            # import ends (torch's C initialisation would swallow it)
            with deferred_signals():
                from h3quant.pipelines.convert.run import convert_layers

            results = convert_layers(plan, stream, bar)
    finally:
        bar.close()
    return build_report(plan, results, time.perf_counter() - t0)


def open_writers(plan: ConvertPlan, stack: contextlib.ExitStack, out: Path) -> dict[str, OffsetWriter]:
    """One writer per shard, writing into ``out`` (staged by the caller). Sharded output: on
    success the shards are complete (writers exit first), then the index is written."""
    if not plan.directory:
        (name, shard), = plan.shards.items()
        return {name: stack.enter_context(OffsetWriter(out, shard.planned_layout))}

    def index_on_success(exc_type, exc, tb):
        if exc_type is None:
            write_index(plan, out)
        return False

    stack.push(index_on_success)
    return {name: stack.enter_context(OffsetWriter(out / name, s.planned_layout))
            for name, s in plan.shards.items()}


def write_index(plan: ConvertPlan, tmp: Path) -> None:
    """The shard index, written last (after every shard file is complete)."""
    weight_map = shard_of(plan)
    meta = dict(plan.index_metadata)
    meta["total_size"] = sum(sp.planned_layout.data_bytes for sp in plan.shards.values())
    body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    assert plan.index_name is not None  # a sharded plan names its index
    with open(tmp / plan.index_name, "wb") as fh:
        fh.write((json.dumps(body, indent=2) + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
