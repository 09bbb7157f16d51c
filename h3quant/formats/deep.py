"""Data checks (``validate --deep``): read tensors layer by layer and check their values.

Memory stays bounded: scales and codebooks are small and read whole; weights are streamed in
CHUNK_BYTES pieces through plain reads into one reused buffer (never memory-mapped).
Codes: D101 non-finite scale, D102 non-positive scale, D103 int8 code -128, D104 bad codebook,
D106 non-finite float weight: a stored float weight, or any supported format's weight decoded
as convert and verify decode it (the codec's ``decode_rows``), so a finite scale whose decoded
weights overflow gets the same verdict from every command.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from h3quant.errors import ContainerError, H3QuantError
from h3quant.findings import Finding
from h3quant.formats import check as rules
from h3quant.formats import registry
from h3quant.formats.container.dtypes import FLOAT_DTYPES, itemsize, to_torch

CHUNK_BYTES = 16 << 20
DECODE_BYTES = 16 << 20  # fp32 bytes of decoded weight rows at once



class Stream:
    """Plain buffered reads into one reused chunk buffer per tensor.

    The data checks read each byte once, sequentially; memory-mapping would leave every touched
    page resident (RSS grows to the file size), so they never map, whatever the reader's mode.
    """

    def __init__(self) -> None:
        self._files: dict = {}

    def iter(self, info, chunk: int) -> Iterator[memoryview]:
        """The tensor's bytes, ``chunk`` at a time, as views of a buffer reused between chunks."""
        fh = self._files.get(info.file)
        if fh is None:
            fh = self._files[info.file] = open(info.file, "rb", buffering=0)
        buf = memoryview(bytearray(min(chunk, info.nbytes)))
        pos = info.begin
        while pos < info.end:
            n = min(chunk, info.end - pos)
            fh.seek(pos)
            got = fh.readinto(buf[:n])
            if got != n:
                raise ContainerError(f"short read: {got} of {n} bytes at offset {pos}",
                                     path=info.file, tensor=info.name, code="C109")
            yield buf[:n]
            pos += n

    def rows(self, info, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` (dim 0) of a tensor, as a copy in its own dtype and shape."""
        dtype = to_torch(info.dtype)
        row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        if r1 <= r0 or row == 0:
            return torch.empty((max(r1 - r0, 0), *info.shape[1:]), dtype=dtype)
        fh = self._files.get(info.file)
        if fh is None:
            fh = self._files[info.file] = open(info.file, "rb", buffering=0)
        buf = bytearray((r1 - r0) * row)
        fh.seek(info.begin + r0 * row)
        got = fh.readinto(buf)
        if got != len(buf):
            raise ContainerError(f"short read: {got} of {len(buf)} bytes at offset "
                                 f"{info.begin + r0 * row}", path=info.file, tensor=info.name,
                                 code="C109")
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(
            (r1 - r0, *info.shape[1:]))

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def _chunks(src: Stream, info, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """1-D tensors of ``dtype`` covering the tensor's bytes, CHUNK_BYTES at a time.

    Each chunk views a reused buffer: consume it before asking for the next.
    """
    size = itemsize(info.dtype)
    chunk = max(CHUNK_BYTES - CHUNK_BYTES % size, size)
    for raw in src.iter(info, chunk):
        yield torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def _read(src, info, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor read whole as 1-D ``dtype`` (default: its own), as a copy."""
    dtype = dtype or to_torch(info.dtype)
    parts = [c.clone() for c in _chunks(src, info, dtype)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_scale(values: torch.Tensor, info, out: list[Finding]) -> None:
    for v in rules.scale_violations(values):  # the rule convert applies to its source too
        out.append(Finding(v.code, v.message, tensor=info.name, file=str(info.file)))


def _check_int8_codes(src, info, out: list[Finding]) -> None:
    count = 0
    for part in _chunks(src, info, torch.int8):
        if part.numel() and int(part.amin()) > -128:
            continue
        count += int((part == -128).sum())
    if count:
        out.append(Finding("D103", f"{count} of {info.numel} int8 codes are -128; encoders clamp "
                           "symmetric codes to [-127, 127] (legal, but this file was not written "
                           "by the reference quantizer)", tensor=info.name, file=str(info.file)))


def _check_whole(src, codec, suffix: str, info, out: list[Finding]) -> None:
    v = codec.checks.data_violation(suffix, _read(src, info).reshape(tuple(info.shape)))  # as convert
    # and verify see it: the same rule
    if v is not None:
        out.append(Finding(v.code, v.message, tensor=info.name, file=str(info.file)))


def _check_float(src, info, out: list[Finding]) -> None:
    dtype = to_torch(info.dtype)
    bad = 0
    first = None
    seen = 0
    for part in _chunks(src, info, dtype):
        if part.numel() and torch.isfinite(part.abs().amax()):  # fast path: max propagates NaN
            seen += part.numel()
            continue
        mask = ~torch.isfinite(part)
        n = int(mask.sum())
        if n and first is None:
            first = seen + _first(mask)
        bad += n
        seen += part.numel()
    if bad:
        out.append(Finding("D106", f"{bad} of {info.numel} values are NaN or infinite (first at "
                           f"flat index {first}); expected finite weights",
                           tensor=info.name, file=str(info.file)))


def _check_decoded(src, layer, codec, out: list[Finding]) -> None:
    """The layer's weight decoded as convert reads its source (``decode_rows`` of the stored
    tensors, row chunks of DECODE_BYTES): every value finite (D106), one rule for every
    format, so a finite scale whose decoded weights overflow (3e38) is found as convert and
    verify find it."""
    n, k = rules.logical_shape(layer)
    t, f = layer.tensors, layer.fields or {}
    w = t.get("weight")
    if not n or not k or w is None:
        return
    row_names, whole_names = codec.decoder.source_tensors(f, t)
    if any(s not in t for s in (*row_names, *whole_names, *codec.spec.storage.column_sources)):
        return  # the header rules report what is missing
    whole = {s: _read(src, t[s]).reshape(tuple(t[s].shape)) for s in whole_names}
    cols = {s: _read(src, t[s]).reshape(tuple(t[s].shape)) for s in codec.spec.storage.column_sources}
    views = codec.decoder.row_views(whole, f)
    step = max(1, DECODE_BYTES // (4 * k))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows: dict = {s: src.rows(t[s], r0, r1) for s in row_names}
        rows.update({s: c[:, r0:r1].t() for s, c in cols.items()})
        if codec.spec.runtime.needs_row0:
            rows["_row0"] = r0
        rows.update({s: v[r0:r1] for s, v in views.items()})
        v = rules.weight_violation(codec.decoder.decode_rows(rows, whole, f), r0 * k)
        if v is not None:
            out.append(Finding(v.code, f"{v.message} once decoded from the stored "
                               f"{codec.spec.name} tensors (as convert and verify decode them)",
                               tensor=w.name, file=str(w.file)))
            return


def _check_layer(src, layer, checked: set[str], out: list[Finding]) -> None:
    before = len(out)
    fmt = layer.format
    t = layer.tensors
    codec = registry.get(fmt) if fmt is not None else None
    if codec is not None:  # supported formats: their scale tensors must be finite and > 0
        for suffix in codec.spec.verify.deep_scales:
            info = t.get(suffix)
            if info is None or info.dtype not in FLOAT_DTYPES | {"F8_E4M3", "U8"}:
                continue
            # A U8 s_rel holds e4m3 bit patterns.
            dtype = torch.float8_e4m3fn if info.dtype in ("F8_E4M3", "U8") else None
            _check_scale(_read(src, info, dtype), info, out)
            checked.add(info.name)
        if hasattr(codec.checks, "deep_findings"):  # a format package's own data rules
            for v in codec.checks.deep_findings(lambda i, dt: _chunks(src, i, dt), t):
                info = t.get(v.suffix) or t.get("weight")
                out.append(Finding(v.code, v.message, tensor=info.name, file=str(info.file)))
                checked.add(info.name)
        w = t.get("weight")
        if codec.spec.relayout.int8_codes and w is not None and w.dtype == "I8":
            _check_int8_codes(src, w, out)
        for suffix in codec.spec.verify.deep_whole:
            info = t.get(suffix)
            if info is not None and (info.dtype in FLOAT_DTYPES or info.dtype == "I8"):
                _check_whole(src, codec, suffix, info, out)
                checked.add(info.name)
        for v in codec.checks.layer_data_violations(t, lambda info, dtype=None: _read(src, info, dtype),
                                             layer.fields or {}):
            info = t.get(v.suffix) or t.get("weight")
            out.append(Finding(v.code, v.message, tensor=layer.tensor_name(v.suffix),
                               file=str(info.file) if info is not None else None))
        w = t.get("weight")
        if w is not None and len(out) == before:  # one finding per broken layer
            _check_decoded(src, layer, codec, out)
            checked.add(w.name)
    elif fmt is not None:
        # Unsupported formats: float scales must at least be finite (block scales may be 0).
        for suffix, info in t.items():
            if "scale" in suffix and info.dtype in FLOAT_DTYPES:
                v = _read(src, info).float()
                if not torch.isfinite(v).all():
                    _check_scale(v, info, out)
                checked.add(info.name)


_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _check_fp8(src, info, scale, out: list[Finding]) -> None:
    """A scaled-fp8 (or bare fp8) weight decoded as ComfyUI decodes it: every value finite."""
    codes = _read(src, info, _FP8[info.dtype]).reshape(info.shape)
    s = None
    if scale is not None:
        s = _read(src, scale).float()
    v = rules.fp8_weight_violation(codes, s)
    if v is not None:
        out.append(Finding(v.code, v.message + (" (decoded: code x " + scale.name.rsplit(".", 1)[-1]
                                               + ")" if scale is not None else ""),
                           tensor=info.name, file=str(info.file)))


def fp8_weights(tensors) -> dict:
    """fp8 weight name -> its scale's name (None: no scale) for every fp8 ``*.weight``."""
    from h3quant.formats.check import FP8_SCALE_NAMES as FP8_SCALES

    out = {}
    for name, info in tensors.items():
        if info.dtype in _FP8 and name.endswith(".weight") and len(info.shape) >= 1:
            stem = name[: -len(".weight")]
            scales = [f"{stem}.{s}" for s in FP8_SCALES if f"{stem}.{s}" in tensors]
            out[name] = scales[0] if scales else None
    return out


def deep_check(ckpt, scan, on_bytes=None) -> list[Finding]:
    """Value checks over every layer (one at a time), then every fp8 weight decoded, then
    every remaining float tensor; ``on_bytes(n)`` (progress) is told the bytes of each layer or
    tensor once checked."""
    out: list[Finding] = []
    checked: set[str] = set()
    src = Stream()
    tell = on_bytes or (lambda n: None)
    try:
        for layer in scan.layers.values():
            _guarded(out, layer.name, _check_layer, src, layer, checked, out)
            tell(sum(t.nbytes for t in layer.tensors.values()))
        for name, scale in sorted(fp8_weights(ckpt.tensors).items()):
            if name in checked:
                continue
            info = ckpt.tensors[name]
            sinfo = ckpt.tensors[scale] if scale is not None else None
            if sinfo is not None and sinfo.dtype not in FLOAT_DTYPES:
                continue  # not ComfyUI's scaled fp8 (the marker rules judge it)
            _guarded(out, name, _check_fp8, src, info, sinfo, out)
            checked.add(name)
            tell(info.nbytes)
        for name, info in ckpt.tensors.items():
            if name in checked or info.dtype not in FLOAT_DTYPES or info.numel == 0:
                continue
            _guarded(out, name, _check_float, src, info, out)
            tell(info.nbytes)
    finally:
        src.close()
    return out


def _guarded(out: list[Finding], where: str, fn, *args) -> None:
    """One layer's failure (a short read, an unreadable chunk) must not stop the others."""
    try:
        fn(*args)
    except OSError as exc:
        out.append(Finding("C112", f"data check stopped, read failed: {exc.strerror or exc}",
                           tensor=where, file=exc.filename))
    except (H3QuantError, RuntimeError, ValueError) as exc:
        code = getattr(exc, "code", None)
        code = code if code in ("C109", "C112") else "X101"
        out.append(Finding(code, f"data check stopped: {exc}", tensor=where))
