"""Synthetic H3-shaped checkpoints: the real tensor names, dtypes and shapes, seeded random data.

The header is planned first, then each tensor is generated and streamed in row chunks of about
4 M elements, so memory stays small (a few hundred MB at most) whatever the preset.

Data (deterministic: same preset, form, blocks and seed give the same bytes):
- each row chunk of each tensor draws from its own PCG64 stream seeded by
  ``(seed, crc32(name), chunk + 1)`` (chunk boundaries depend only on the shape), so chunks are
  generated on several threads while the file is written, and the bytes never depend on that;
- Gaussian values come from 16 random bits per element mapped through a 65536-entry inverse
  normal CDF table (fast on a slow CPU; tails reach ~4.3 sigma, enough for K <= 14336 rows);
- linears: std 1/sqrt(K); the DiT/refiner block linears and ``condition_proj`` also get 6
  outlier INPUT channels (whole columns x10..x30) so ConvRot's benefit is measurable;
- norms: 1 + 0.05 N(0,1); biases: 0.01 N(0,1); ``rope.inv_freq``: 10000^(-i/16);
  ``adaln_t_table``: smooth sinusoids over the 1025 rows.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from h3quant.errors import UnsupportedError
from h3quant.h3.topology import (
    BANK_TENSORS,
    BLOCK_LINEARS,
    H3Config,
    config_for,
    expected_tensors,
)
from h3quant.formats.container.writer import Entry, StreamingWriter, plan_layout

SYNTH_VERSION = 1
CHUNK_ELEMS = 1 << 22
OUTLIER_CHANNELS = 6
METADATA_KEY = "h3quant.synth"
MAX_HEAD_BANK = 64

_NORM_RE = re.compile(r"(?:^|\.)(?:norm\d*|q_norm|k_norm|final_norm)\.weight$")
_OUTLIER_LAYERS = tuple(f".{sub}.weight" for sub in BLOCK_LINEARS) + ("condition_proj.weight",)


@dataclass(frozen=True)
class SynthResult:
    path: Path
    config: H3Config
    nbytes: int
    tensors: int


@functools.lru_cache(maxsize=1)
def _quantiles() -> np.ndarray:
    """The 65536 equiprobable N(0,1) quantiles, float64."""
    p = (torch.arange(65536, dtype=torch.float64) + 0.5) / 65536
    return torch.special.ndtri(p).numpy()


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (finite inputs)."""
    b = x.astype("<f4", copy=False).view("<u4").astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype("<u2")


def _table(mean: float, std: float, dtype: str) -> np.ndarray:
    """16-bit code -> value of ``mean + std * N(0,1)``, stored as the output's raw element type."""
    values = mean + std * _quantiles()
    if dtype == "BF16":
        return _bf16_bits(values.astype(np.float32))
    if dtype == "F32":
        return values.astype("<f4")
    raise UnsupportedError(f"synth has no generator for dtype {dtype}")


def _stream(seed: int, name: str, index: int | None = None) -> np.random.PCG64:
    key = [seed, zlib.crc32(name.encode("utf-8"))] + ([] if index is None else [index + 1])
    return np.random.PCG64(np.random.SeedSequence(key))


def _codes(bits: np.random.PCG64, n: int) -> np.ndarray:
    raw = bits.random_raw((n + 3) // 4).astype("<u8", copy=False)
    return raw.view("<u2")[:n]


def _uniform(bits: np.random.PCG64, n: int) -> np.ndarray:
    return (bits.random_raw(n) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _outliers(bits: np.random.PCG64, k: int) -> list[tuple[int, float]]:
    """``OUTLIER_CHANNELS`` distinct input columns with a x10..x30 scale each."""
    cols: list[int] = []
    while len(cols) < min(OUTLIER_CHANNELS, k):
        for v in bits.random_raw(4 * OUTLIER_CHANNELS):
            c = int(v % np.uint64(k))
            if c not in cols and len(cols) < OUTLIER_CHANNELS:
                cols.append(c)
    scales = 10.0 + 20.0 * _uniform(bits, len(cols))
    return sorted(zip(cols, (float(s) for s in scales)))


def _gaussian_jobs(seed, name, shape, dtype, mean, std, outliers=()) -> list[Callable]:
    """One job per row chunk; chunk ``i`` draws from its own stream ``(seed, crc32(name), i)``."""
    table = _table(mean, std, dtype)
    rows, k = (shape[0], shape[1]) if len(shape) == 2 else (1, math.prod(shape))
    extra = [(c, _table(mean, std * s, dtype)) for c, s in outliers]
    step = max(1, CHUNK_ELEMS // max(k, 1))

    def job(index: int, n: int) -> np.ndarray:
        codes = _codes(_stream(seed, name, index), n * k).reshape(n, k)
        out = np.take(table, codes)
        for c, t in extra:
            out[:, c] = np.take(t, codes[:, c])
        return out

    return [functools.partial(job, i, min(step, rows - r0))
            for i, r0 in enumerate(range(0, rows, step))]


def _smooth_table(bits, shape) -> np.ndarray:
    rows, cols = shape
    amp, freq, phase = (_uniform(bits, cols) for _ in range(3))
    s = np.linspace(0.0, 1.0, rows)[:, None]
    values = (0.5 + amp) * np.sin(np.pi * (1.0 + 3.0 * freq) * s + 2.0 * np.pi * phase)
    return values.astype("<f4")


def tensor_jobs(entry: Entry, seed: int) -> list[Callable[[], np.ndarray]]:
    """Callables that each return the next row chunk of one synthetic tensor (raw little-endian
    arrays); they are independent, so they may run in parallel."""
    name, shape, dtype = entry.name, entry.shape, entry.dtype
    if name.endswith("rope.inv_freq"):
        n = shape[0]
        return [lambda: (10000.0 ** (-np.arange(n, dtype=np.float64) / n)).astype("<f4")]
    if name.endswith("adaln_t_table"):
        return [lambda: _smooth_table(_stream(seed, name), shape)]
    if name.endswith(".bias"):
        return _gaussian_jobs(seed, name, shape, dtype, 0.0, 0.01)
    if _NORM_RE.search(name):
        return _gaussian_jobs(seed, name, shape, dtype, 1.0, 0.05)
    k = shape[-1] if shape else 1
    outliers = (_outliers(_stream(seed, name), k)
                if name.endswith(_OUTLIER_LAYERS) and k >= 256 else ())
    return _gaussian_jobs(seed, name, shape, dtype, 0.0, 1.0 / math.sqrt(k), outliers)


def tensor_chunks(entry: Entry, seed: int) -> Iterator[np.ndarray]:
    """The data of one synthetic tensor, chunk by chunk, in this thread."""
    for job in tensor_jobs(entry, seed):
        yield job()


def _all_jobs(order, seed: int) -> Iterator[tuple[str, Callable]]:
    for entry in order:
        for job in tensor_jobs(entry, seed):
            yield entry.name, job


def _run_ordered(jobs: Iterator[tuple[str, Callable]], workers: int = 2,
                 window: int = 4) -> Iterator[tuple[str, np.ndarray]]:
    """Run jobs on ``workers`` threads (numpy releases the GIL), ``window`` ahead, in order."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="h3quant-synth") as pool:
        pending: deque = deque()
        try:
            for name, job in jobs:
                pending.append((name, pool.submit(job)))
                if len(pending) >= window:
                    name0, fut = pending.popleft()
                    yield name0, fut.result()
            while pending:
                name0, fut = pending.popleft()
                yield name0, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


def synth_metadata(cfg: H3Config, preset: str, seed: int, head_bank: int = 1) -> dict[str, str]:
    info = {"preset": preset, "form": cfg.form, "blocks": cfg.blocks, "seed": seed,
            "version": SYNTH_VERSION}
    if head_bank > 1:
        info["head_bank"] = head_bank
    return {"format": "pt", METADATA_KEY: json.dumps(info, sort_keys=True)}


def synth_checkpoint(path: str | os.PathLike, *, preset: str = "tiny", blocks: int | None = None,
                     form: str = "pruned", seed: int = 0, progress: bool = False,
                     workers: int | None = None, head_bank: int = 1) -> SynthResult:
    """Write an H3-shaped plain checkpoint to ``path`` (atomically; an existing file is replaced).
    ``head_bank``: stack that many output heads in ``final_layer.video_out`` / ``audio_out``
    (``n * 96`` / ``n * 32`` rows, as few-step checkpoints do); 1 writes the plain heads."""
    if not isinstance(seed, int) or seed < 0:
        raise UnsupportedError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(head_bank, int) or not 1 <= head_bank <= MAX_HEAD_BANK:
        raise UnsupportedError(f"head_bank must be in 1..{MAX_HEAD_BANK}, got {head_bank!r}")
    cfg = config_for(preset, blocks=blocks, form=form)
    workers = workers or min(4, os.cpu_count() or 1)
    tensors = expected_tensors(cfg)
    for name in BANK_TENSORS if head_bank > 1 else ():
        dtype, shape = tensors[name]
        tensors[name] = (dtype, (shape[0] * head_bank, *shape[1:]))
    entries = [Entry(n, d, s) for n, (d, s) in tensors.items()]
    layout = plan_layout(entries, synth_metadata(cfg, preset, seed, head_bank))
    path = Path(path)
    from tqdm import tqdm

    with tqdm(total=layout.file_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=not progress, desc=path.name, leave=False) as bar:
        with StreamingWriter(path, layout) as writer:
            bar.update(len(layout.header))
            for name, chunk in _run_ordered(_all_jobs(layout.order, seed), workers=workers):
                writer.write(name, chunk)
                bar.update(chunk.nbytes)
    return SynthResult(path, cfg, layout.file_bytes, len(entries))
