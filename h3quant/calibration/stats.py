"""The statistics file: per-linear input second moments of one checkpoint, and its reader.

A safetensors file. For each DiT block linear ``blocks.{i}.{attn.qkv_proj,attn.out_proj,
mlp.fc1,mlp.fc2}`` (the name without the checkpoint's prefix):

* ``{layer}.hessian``: ``H = X^T X`` summed over every input row the linear saw (every call,
  every modality: text, audio and video rows alike), in the layer's plain input basis. From
  version 3 its upper triangle, row by row, F32 ``[K (K + 1) / 2]`` (``H`` is symmetric: half
  the bytes, the same values; ``pack_upper`` / ``unpack_upper``); versions 1 and 2 hold the
  whole F32 ``[K, K]`` matrix. A format that quantizes in the ConvRot basis uses ``R^T H R`` (``R`` the block-diagonal
  Hadamard of its group size), computed when the statistics are used, so one file serves every
  group size;
* ``{layer}.absmean``: F32 ``[K]``, the mean ``|x|`` of each input channel (activation-aware
  scaling);
* from version 2: ``{layer}.absmax``: F32 ``[K]``, the max ``|x|`` of each input channel, and
  ``{layer}.sample``: F32 ``[S, K]``, ``S`` whole input rows evenly spaced over every row the
  layer saw (the same ``S`` for every layer, metadata ``sample_rows``): smoothing
  (``calibration.smooth``) models the target format's per-token activation rounding on them.
  A version 1 file serves error feedback and AWQ as before; smoothing refuses it.
* version 3: version 2 with the Hessian packed (above).

The metadata key ``h3quant.calibration`` holds JSON: ``version``, ``checkpoint`` (the header
checksum of the checkpoint measured, ``calibration.fingerprint``), ``blocks`` (its block
count), ``inputs`` (each input's file name, sha256, sigma and, when the file records one, its
seed), ``rows`` (rows per layer), ``forward`` (``float``: the checkpoint's own weights in float
math, or the checksum of the checkpoint the forward ran through, ``through``).

A file is checked whole when it is opened, before any layer uses it, so every command that
reads it (convert with any calibrated format, plan) gives it one verdict: from its header the
names, dtypes and shapes (every ``.absmean`` beside its ``.hessian``), then from its values,
one layer at a time: every value finite, each mean ``|x|`` >= 0, each Hessian symmetric
(``|H - H^T| <= SYMMETRY_TOL x max diag``) with a non-negative diagonal and
``|H_ij| <= sqrt(H_ii H_jj)`` (as ``X^T X`` always is, to the same tolerance).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from h3quant.calibration.meta import META_KEY
from h3quant.errors import UsageError

VERSION = 3
READABLE = (1, 2, 3)  # 1: no absmax / sample (smoothing refuses it); 3: the Hessian packed
PACKED_FROM = 3  # the first version whose Hessian is the packed upper triangle
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
MAX_K = 65536  # an input width beyond any H3 linear: refused from the header
SYMMETRY_TOL = 1e-4  # |H - H^T| allowed, relative to H's largest diagonal entry
_KEY_RE = re.compile(r"(?:^|\.)(blocks\.\d+\.(?:attn\.qkv_proj|attn\.out_proj|mlp\.fc1|mlp\.fc2))$")


def layer_key(name: str) -> str | None:
    """``blocks.{i}.{linear}`` of a checkpoint layer name (None: not a DiT block linear; the
    token refiner's blocks are not DiT blocks)."""
    m = _KEY_RE.search(name)
    if m is None or name[:m.start(1)].endswith("token_refiner."):
        return None
    return m.group(1)


def packed_size(k: int) -> int:
    """Values in the upper triangle (diagonal included) of a ``[K, K]`` matrix."""
    return k * (k + 1) // 2


def pack_upper(h: torch.Tensor) -> torch.Tensor:
    """The upper triangle of ``h`` ``[K, K]``, row by row: ``[K (K + 1) / 2]``, the same dtype."""
    k = int(h.shape[0])
    out = torch.empty(packed_size(k), dtype=h.dtype)
    off = 0
    for i in range(k):
        out[off:off + k - i] = h[i, i:]
        off += k - i
    return out


def unpack_upper(p: torch.Tensor, k: int) -> torch.Tensor:
    """The symmetric ``[K, K]`` matrix whose upper triangle ``pack_upper`` gave: every value
    copied, none computed (the lower triangle mirrors the upper, a band of rows at a time)."""
    h = torch.empty(k, k, dtype=p.dtype)
    off = 0
    for i in range(k):
        h[i, i:] = p[off:off + k - i]
        off += k - i
    step = max(1, (4 << 20) // max(k, 1))
    for r0 in range(0, k, step):
        r1 = min(k, r0 + step)
        h[r0:r1, :r0] = h[:r0, r0:r1].t()
        band = h[r0:r1, r0:r1]
        upper = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool).triu()
        band.copy_(torch.where(upper, band, band.t()))
    return h


def _fail(path, reason: str, tensor: str | None = None) -> UsageError:
    return UsageError(f"--calibration: {reason}", path=path, tensor=tensor)


@dataclass
class LayerStats:
    """One linear's statistics; the calibration object a codec's ``encode`` takes.

    ``feedback(x, quantize, convrot=, group_size=)``: the codes of ``x`` (rows in the codec's
    basis) chosen by GPTQ-class error feedback (``calibration.gptq``) with this layer's Hessian
    in that basis. The factor of each basis is computed once, under a lock (row chunks of one
    layer encode on several threads)."""

    key: str
    k: int
    rows: int
    _load: Callable[[], torch.Tensor] | None = None  # () -> fp32 [K, K] plain-basis Hessian
    absmean: torch.Tensor | None = None
    _h: torch.Tensor | None = None
    _load_absmean: Callable[[], torch.Tensor] | None = None  # () -> fp32 [K] mean |x|
    _load_absmax: Callable[[], torch.Tensor] | None = None  # () -> fp32 [K] max |x| (v2)
    _load_sample: Callable[[], torch.Tensor] | None = None  # () -> fp32 [S, K] rows (v2)
    _rounding: Callable | None = None  # the runtime's input rounding (calibration.aware)
    _factors: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_hessian(cls, key: str, h: torch.Tensor, rows: int,
                     absmean: torch.Tensor | None = None) -> "LayerStats":
        h = h.to(torch.float32)
        return cls(key, int(h.shape[0]), int(rows), None, absmean, h)

    def hessian(self, convrot: bool = False, group_size: int = 256) -> torch.Tensor:
        """``H`` in the plain basis, or ``R^T H R`` in the ConvRot basis of ``group_size``."""
        if self._h is None:
            if self._load is None:
                raise ValueError(f"{self.key}: statistics without a Hessian")
            self._h = self._load()
        if not convrot:
            return self._h
        from h3quant.convrot import check_group_size, hadamard

        check_group_size(group_size)
        k, g = self.k, group_size
        hg = hadamard(g).to(torch.float64)
        a = (self._h.to(torch.float64).reshape(k, k // g, g) @ hg).reshape(k, k)  # H R
        return (a.t().reshape(k, k // g, g) @ hg).reshape(k, k).t()  # R^T H R (R symmetric)

    def factor(self, convrot: bool, group_size: int) -> torch.Tensor:
        from h3quant.calibration.gptq import inverse_factor

        key = (bool(convrot), int(group_size) if convrot else 0)
        with self._lock:
            if key not in self._factors:
                try:
                    self._factors[key] = inverse_factor(self.hessian(convrot, group_size))
                except torch.linalg.LinAlgError:  # passed the checks, yet not factorable
                    raise UsageError(f"--calibration: the Hessian of {self.key} is not positive "
                                     "definite even after damping; capture the statistics "
                                     "again", tensor=f"{self.key}.hessian") from None
            return self._factors[key]

    def feedback(self, x: torch.Tensor, quantize, *, convrot: bool, group_size: int = 256,
                 groups=None):
        """``calibration.gptq.feedback`` with this layer's factor (``groups``: its lazy group
        scales' hook)."""
        from h3quant.calibration.gptq import aware_solve, feedback

        system = self.aware_system(convrot, group_size)
        if system is None:
            return feedback(x, self.factor(convrot, group_size), quantize, groups=groups)
        cd, lower, u = system
        return feedback(aware_solve(x, cd, lower), u, quantize, groups=groups)

    def rounded_by(self, rounding) -> "LayerStats":
        """These statistics with the runtime's input rounding ``rounding``
        (``calibration.aware.input_rounding``; None: the plain feedback): ``feedback`` then
        minimises ``|X W^T - Xq Wq^T|^2`` where the file's sampled rows allow (version 2)."""
        return LayerStats(self.key, self.k, self.rows, self._load, self.absmean, self._h,
                          self._load_absmean, self._load_absmax, self._load_sample, rounding)

    def aware_system(self, convrot: bool, group_size: int = 256):
        """(``C + lam``, lower factor of the damped ``Hq``, ``Hq``'s inverse factor) in the codes'
        basis (``calibration.aware``), computed once; None where the plain feedback applies: no
        rounding, no sampled rows, or sampled rows the rounding leaves as they are."""
        if self._rounding is None or self._load_sample is None:
            return None
        from h3quant.calibration.gptq import damped, gains_and_noise, inverse_factor

        key = ("aware", bool(convrot), int(group_size) if convrot else 0)
        with self._lock:
            if key not in self._factors:
                h = self.hessian(convrot, group_size).to(torch.float64, copy=True)
                x, xq = self._rounding(self.sample())
                a, v = gains_and_noise(x, xq, h.diagonal())
                if bool((a == 1).all()) and not bool(v.any()):
                    self._factors[key] = None
                    return None
                hq = h * a[:, None] * a[None, :]  # diag(a) H diag(a) + diag(v)
                hq.diagonal().add_(v)
                hd = damped(hq)
                lam = hd.diagonal() - hq.diagonal()  # damping (and dead inputs' unit diagonal)
                del hq
                try:
                    u = inverse_factor(hd, damp=0.0)  # hd is damped already: no more
                    lower = torch.linalg.cholesky(hd)
                except torch.linalg.LinAlgError:
                    raise UsageError(f"--calibration: the Hessian of {self.key}'s rounded "
                                     "inputs is not positive definite even after damping",
                                     tensor=f"{self.key}.hessian") from None
                del hd
                cd = h.mul_(a[None, :])  # C = H diag(a), plus the damping
                cd.diagonal().add_(lam)
                self._factors[key] = (cd, lower, u)
            return self._factors[key]

    def predicted_gain_db(self, convrot: bool, group_size: int = 256) -> float:
        from h3quant.calibration.gptq import damped, gain_from_factor

        u = self.factor(convrot, group_size)  # the factor error feedback uses (cached)
        trace = float(damped(self.hessian()).diagonal().sum())  # a rotation keeps the trace
        return gain_from_factor(trace, u)

    def channel_absmean(self) -> torch.Tensor | None:
        """The mean ``|x|`` per input channel (read from the file on first use), or None."""
        if self.absmean is None and self._load_absmean is not None:
            self.absmean = self._load_absmean()
        return self.absmean

    @property
    def has_rows(self) -> bool:
        """Whether the file holds this layer's channel maxima and sampled rows (version 2)."""
        return self._load_absmax is not None and self._load_sample is not None

    def channel_absmax(self) -> torch.Tensor:
        """The max ``|x|`` per input channel (version 2 files)."""
        if self._load_absmax is None:
            raise ValueError(f"{self.key}: statistics without channel maxima")
        return self._load_absmax()

    def sample(self) -> torch.Tensor:
        """The sampled input rows ``[S, K]`` (version 2 files)."""
        if self._load_sample is None:
            raise ValueError(f"{self.key}: statistics without sampled rows")
        return self._load_sample()

    def scaled(self, s: torch.Tensor) -> "LayerStats":
        """The statistics of the inputs divided by ``s`` per channel: ``diag(1/s) H diag(1/s)``
        (computed in fp64), ``absmean / s``; ``s`` all ones gives ``H`` exactly."""
        inv = 1.0 / s.to(torch.float64)
        h = (self.hessian().to(torch.float64) * inv[:, None] * inv[None, :]).to(torch.float32)
        am = self.channel_absmean()
        am = None if am is None else (am.double() * inv).float()
        return LayerStats.from_hessian(self.key, h, self.rows, am)

    def divided(self, s: torch.Tensor) -> "LayerStats":
        """Like ``scaled``, but lazy and reloadable: the statistics of ``x / s`` computed from
        this layer's on each load (``release`` drops them; a later use computes them again)."""
        inv = 1.0 / s.to(torch.float64)

        def load_h():
            h = self.hessian().to(torch.float64)
            self.release()
            return (h * inv[:, None] * inv[None, :]).to(torch.float32)

        def per_channel(load):
            return None if load is None else (lambda: (load().double() * inv).float())

        def absmean() -> torch.Tensor:
            am = self.channel_absmean()
            if am is None:
                raise ValueError(f"{self.key}: statistics without channel magnitudes")
            return am

        return LayerStats(self.key, self.k, self.rows, load_h,
                          _load_absmean=per_channel(absmean),
                          _load_absmax=per_channel(self._load_absmax),
                          _load_sample=per_channel(self._load_sample))

    def release(self) -> None:
        """Drop the Hessian and its factors (the layer is done)."""
        self._h = None
        self._factors.clear()
        if self._load_absmean is not None:
            self.absmean = None


class Statistics:
    """An open statistics file (see the module docstring); checked from its header on open."""

    def __init__(self, path: str | os.PathLike):
        from h3quant.errors import ContainerError
        from h3quant.formats.container.reader import SafetensorsFile

        self.path = str(path)
        try:
            self._fh = SafetensorsFile(path, mmap=False)
        except ContainerError as exc:
            raise _fail(path, exc.reason) from None
        try:
            self.meta = self._parse_meta()
            self.layers = self._parse_layers()
            self._check_values()
        except BaseException:
            self._fh.close()
            raise

    def _parse_meta(self) -> dict:
        raw = self._fh.metadata.get(META_KEY)
        if raw is None:
            raise _fail(self.path, f"no {META_KEY!r} metadata: not a statistics file written by "
                        "'h3quant capture'")
        try:
            meta = json.loads(raw)
        except ValueError:
            raise _fail(self.path, f"the {META_KEY!r} metadata is not JSON") from None
        if not isinstance(meta, dict) or meta.get("version") not in READABLE:
            raise _fail(self.path, f"statistics version {meta.get('version') if isinstance(meta, dict) else '?'}"
                        f" is not one of {', '.join(map(str, READABLE))}")
        for key, kind in (("checkpoint", str), ("blocks", int), ("rows", dict), ("inputs", list)):
            if not isinstance(meta.get(key), kind):
                raise _fail(self.path, f"metadata field {key!r} is missing or not a {kind.__name__}")
        return meta

    def _parse_layers(self) -> dict[str, LayerStats]:
        tensors = self._fh.tensors
        rows = self.meta["rows"]
        out: dict[str, LayerStats] = {}
        for name in tensors:
            if name.endswith(".absmean") and name[:-len(".absmean")] + ".hessian" not in tensors:
                raise _fail(self.path, f"{name[:-len('.absmean')]}.hessian is missing (each "
                            "layer holds {layer}.hessian and {layer}.absmean)",
                            name[:-len(".absmean")] + ".hessian")
        for name, info in tensors.items():
            if not name.endswith(".hessian"):
                continue
            key = name[:-len(".hessian")]
            if layer_key(key) != key:
                raise _fail(self.path, "not a DiT block linear", name)
            shape = self._hessian_shape(name, info, tensors.get(key + ".absmean"))
            am = tensors.get(key + ".absmean")
            if am is None or am.dtype != "F32" or tuple(am.shape) != (shape[0],):
                raise _fail(self.path, f"{key}.absmean is missing or not F32 [{shape[0]}]",
                            key + ".absmean")
            extra = {}
            if self.meta["version"] >= 2:
                srows = self.meta.get("sample_rows")
                if not isinstance(srows, int) or isinstance(srows, bool) or not 0 <= srows <= MAX_K:
                    raise _fail(self.path, f"metadata sample_rows is {srows!r}; a count is needed")
                for part, want in (("absmax", (shape[0],)), ("sample", (srows, shape[0]))):
                    t = tensors.get(f"{key}.{part}")
                    if t is None or t.dtype != "F32" or tuple(t.shape) != want:
                        raise _fail(self.path, f"{key}.{part} is missing or not F32 {list(want)}",
                                    f"{key}.{part}")
                    extra[f"_load_{part}"] = self._reader(f"{key}.{part}")
            n = rows.get(key)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise _fail(self.path, f"metadata rows of {key} is {n!r}; a count is needed", name)
            out[key] = LayerStats(key, shape[0], n, _load=self._reader(name, shape[0] if self.packed else 0),
                                  _load_absmean=self._reader(key + ".absmean"), **extra)
        parts = ("hessian", "absmean") + (("absmax", "sample") if self.meta["version"] >= 2 else ())
        unexpected = sorted(set(tensors) - {f"{k}.{s}" for k in out for s in parts})
        if unexpected:
            raise _fail(self.path, "unexpected tensor (a statistics file holds only "
                        + ", ".join(f"{{layer}}.{p}" for p in parts) + ")", unexpected[0])
        if not out:
            raise _fail(self.path, "the file holds no layer statistics")
        return out

    @property
    def packed(self) -> bool:
        """Whether the Hessians are packed upper triangles (version 3)."""
        return self.meta["version"] >= PACKED_FROM

    def _hessian_shape(self, name: str, info, absmean) -> tuple[int, int]:
        """``(K, K)`` of a Hessian from the header (a packed one's K from its ``.absmean``)."""
        shape = tuple(info.shape)
        if not self.packed:
            if info.dtype != "F32" or len(shape) != 2 or shape[0] != shape[1] or not 0 < shape[0] <= MAX_K:
                raise _fail(self.path, f"hessian is {info.dtype} {list(shape)}; a square F32 "
                            f"matrix of side 1..{MAX_K} is needed", name)
            return shape
        k = int(absmean.shape[0]) if absmean is not None and len(absmean.shape) == 1 else 0
        if not 0 < k <= MAX_K:
            raise _fail(self.path, f"{name[:-len('.hessian')]}.absmean is missing or not F32 "
                        f"[K] (K 1..{MAX_K}): a packed Hessian takes its side from it",
                        name[:-len(".hessian")] + ".absmean")
        if info.dtype != "F32" or shape != (packed_size(k),):
            raise _fail(self.path, f"hessian is {info.dtype} {list(shape)}; version "
                        f"{self.meta['version']} holds the upper triangle of the [{k}, {k}] "
                        f"matrix, F32 [{packed_size(k)}]", name)
        return (k, k)

    def _hessian(self, key: str) -> torch.Tensor:
        """Layer ``key``'s whole ``[K, K]`` Hessian, fp32, as the file holds it (unpacked)."""
        t = self._fh.read(self._fh.tensors[key + ".hessian"]).float()
        return unpack_upper(t, self.layers[key].k) if self.packed else t

    def _check_values(self) -> None:
        """Every layer's values against the rules above, one layer in memory at a time."""
        per_channel = (("absmean", "mean |x|"), ("absmax", "max |x|"))
        for key in sorted(self.layers):
            for part, what in per_channel:
                info = self._fh.tensors.get(f"{key}.{part}")
                if info is None:  # absmax: version 2 only (its presence is checked above)
                    continue
                am = self._fh.read(info).float()
                self._finite(am, f"{key}.{part}")
                neg = am < 0
                if bool(neg.any()):
                    i = int(neg.nonzero()[0, 0])
                    raise _fail(self.path, f"{int(neg.sum())} {what} value(s) are negative "
                                f"(first: {am[i].item()!r} at channel {i}); a {what} is >= 0",
                                f"{key}.{part}")
                del am
            if f"{key}.sample" in self._fh.tensors:
                self._finite(self._fh.read(self._fh.tensors[f"{key}.sample"]).float(),
                             f"{key}.sample")
            h = self._hessian(key)
            self._finite(h, key + ".hessian")
            reason = hessian_violation(h)
            if reason is not None:
                raise _fail(self.path, reason + "; capture the statistics again ('h3quant "
                            "capture')", key + ".hessian")
            del h

    def _finite(self, t: torch.Tensor, name: str) -> None:
        bad = ~torch.isfinite(t.reshape(-1))
        if bool(bad.any()):
            raise _fail(self.path, f"holds {int(bad.sum())} non-finite value(s) (first at flat "
                        f"index {int(bad.nonzero()[0, 0])})", name)

    def _reader(self, name: str, unpack: int = 0):
        """A loader of tensor ``name`` (``unpack``: K of a packed Hessian, unpacked on load)."""
        info = self._fh.tensors[name]
        lock = threading.Lock()

        def load() -> torch.Tensor:
            with lock:
                t = self._fh.read(info).float()
            if unpack:
                t = unpack_upper(t, unpack)
            if not bool(torch.isfinite(t).all()):
                raise _fail(self.path, "holds non-finite values", name)
            return t
        return load

    def absmean(self, key: str) -> torch.Tensor:
        return self._fh.read(self._fh.tensors[key + ".absmean"]).float()

    def layer(self, name: str) -> LayerStats | None:
        """The statistics of checkpoint layer ``name`` (any prefix), None when the file has none."""
        key = layer_key(name)
        return self.layers.get(key) if key else None

    def check_checkpoint(self, fingerprint: str, what: str = "the input") -> None:
        """Refuse statistics measured on another checkpoint (header checksums differ)."""
        if self.meta["checkpoint"] != fingerprint:
            raise _fail(self.path, f"the statistics were measured on another checkpoint "
                        f"({self.meta['checkpoint'][:19]}..., {what} is {fingerprint[:19]}...); "
                        "capture them on this checkpoint ('h3quant capture')")

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "Statistics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hessian_violation(h: torch.Tensor, tol: float = SYMMETRY_TOL) -> str | None:
    """Why ``h`` (finite, [K, K]) cannot be a sum ``X^T X``, or None: a negative diagonal
    entry, asymmetry beyond ``tol x max diag``, or ``|H_ij| > sqrt(H_ii H_jj)`` beyond it.
    Row blocks at a time: memory stays near one block beside ``h``."""
    d = h.diagonal().to(torch.float64)
    if bool((d < 0).any()):
        i = int((d < 0).nonzero()[0, 0])
        return f"diagonal entry {i} is {d[i].item()!r}; a sum of squares is >= 0"
    scale = float(d.max()) if d.numel() else 0.0
    slack = tol * scale
    root = d.clamp_min(0).sqrt()
    k = h.shape[0]
    step = max(1, (4 << 20) // max(k, 1))
    for r0 in range(0, k, step):
        r1 = min(k, r0 + step)
        rows = h[r0:r1].to(torch.float64)
        asym = (rows - h[:, r0:r1].t().to(torch.float64)).abs()
        if float(asym.max()) > slack:
            i, j = divmod(int(asym.argmax()), k)
            return (f"not symmetric: H[{r0 + i}, {j}] = {rows[i, j].item():.6g} but "
                    f"H[{j}, {r0 + i}] = {h[j, r0 + i].item():.6g} (tolerance {slack:.3g}, "
                    f"{tol:g} x the largest diagonal entry)")
        excess = rows.abs() - root[r0:r1, None] * root[None, :]
        if float(excess.max()) > slack:
            i, j = divmod(int(excess.argmax()), k)
            return (f"|H[{r0 + i}, {j}]| = {abs(rows[i, j].item()):.6g} exceeds "
                    f"sqrt(H[{r0 + i}, {r0 + i}] H[{j}, {j}]) = "
                    f"{(root[r0 + i] * root[j]).item():.6g}: not a sum X^T X")
    return None


__all__ = ["LINEARS", "META_KEY", "VERSION", "LayerStats", "Statistics", "layer_key",
           "pack_upper", "packed_size", "unpack_upper"]
