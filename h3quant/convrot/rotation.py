"""ConvRot Hadamard matrices (Kronecker powers of the 4x4 H4, not Sylvester's) and rotation.

``H_g = H4 (x) H4 (x) ... / sqrt(g)`` for ``g = 4**k``; ``x @ H_g`` over a block of ``g`` columns is
``k`` passes of a 4-point transform, one per base-4 digit of the column index. ``1/sqrt(g)`` is a
power of two, so every product below is exact and implementations differ only in the order
they sum, i.e. they agree to fp32 rounding. Three of them:

- ``rotate_dense``: the plain reference, one ``g x g`` matmul per block: the operation
  comfy-kitchen performs, bit-identical to it on the same device and BLAS.
- ``rotate_exact``: bit-identical to ``rotate_dense`` at about half the flops (see there).
- ``rotate``: fast (a few ulps off). On CPU two small matmuls (``H_g = H_a (x) H_b``, i.e. pairs
  of 4-point passes merged into 16-point ones, which MKL runs faster than strided elementwise
  passes); elsewhere ``log4(g)`` elementwise 4-point butterfly passes. Row chunks keep the extra
  memory to a few chunk copies.
"""

from __future__ import annotations

import functools
import threading

import torch

from h3quant.convrot.groups import GroupSizeError, check_group_size, is_valid_group_size  # noqa: F401 (re-exported)

_H4 = ((1.0, 1.0, 1.0, -1.0), (1.0, 1.0, -1.0, 1.0), (1.0, -1.0, 1.0, 1.0), (-1.0, 1.0, 1.0, 1.0))

# Elements per chunk of the fast path (fp32: 1 MiB), sized to stay in L2 cache.
CHUNK_ELEMS = 1 << 18
# Block rows below which a BLAS may switch to small-matrix kernels (seen below 12 with MKL).
DENSE_MIN_ROWS = 64


def _check_last_dim(x: torch.Tensor, g: int) -> None:
    check_group_size(g)
    if x.dim() == 0 or x.shape[-1] % g:
        k = x.shape[-1] if x.dim() else None
        raise GroupSizeError(f"last dim {k} is not a multiple of the ConvRot group size {g}")


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(g: int) -> torch.Tensor:
    check_group_size(g)
    h4 = torch.tensor(_H4, dtype=torch.float64)
    h = h4
    while h.shape[0] < g:
        h = torch.kron(h, h4)
    return (h / (g ** 0.5)).to(torch.float32)


_ON_DEVICE: dict[tuple[str, int, str], torch.Tensor] = {}


def _cached(kind: str, g: int, device: torch.device, build) -> torch.Tensor:
    t = build(g)
    if device.type == "cpu":
        return t
    key = (kind, g, str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]


def hadamard(g: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised ConvRot Hadamard H_g (fp32, symmetric, orthogonal, involutory)."""
    return _cached("h", g, torch.device(device or "cpu"), _hadamard_cpu)


def _as_rows(x: torch.Tensor, g: int) -> tuple[torch.Tensor, int]:
    """fp32 ``[m', K]`` view of ``x`` with at least ``DENSE_MIN_ROWS`` block rows (zero-padded)."""
    k = x.shape[-1]
    xf = x.to(torch.float32).reshape(-1, k)
    m = xf.shape[0]
    need = -(-DENSE_MIN_ROWS * g // k)
    if m < need:
        pad = torch.zeros((need, k), dtype=torch.float32, device=xf.device)
        pad[:m] = xf
        xf = pad
    return xf, m


def rotate_dense(x: torch.Tensor, g: int) -> torch.Tensor:
    """Reference: ``x[..., block] @ H_g`` for every block of ``g`` columns, in fp32.

    The operation comfy-kitchen performs (a matmul of the ``[rows, K/g, g]`` view with ``H_g.T``),
    run over at least ``DENSE_MIN_ROWS`` block rows (zero-padded when fewer): tiny matrices take
    other BLAS kernels with another summation order, so padding makes each row's result
    independent of how many rows are passed. Bit-identical to kitchen's rotation of any weight
    with at least 12 block rows (``N * K / g``) on the same device and BLAS.
    """
    _check_last_dim(x, g)
    k = x.shape[-1]
    xf, m = _as_rows(x, g)
    out = torch.matmul(xf.reshape(-1, k // g, g), hadamard(g, xf.device).T).reshape(-1, k)
    return out[:m].reshape(*x.shape[:-1], k)


@functools.lru_cache(maxsize=16)
def _half_mats_cpu(g: int) -> torch.Tensor:
    """``[2, g/2, g/2]``: rows of each half of H_g, at the columns whose top digit is 0 or 2."""
    h = _hadamard_cpu(g)
    q = g // 4
    reps = torch.cat([torch.arange(0, q), torch.arange(2 * q, 3 * q)])
    return torch.stack([h[: g // 2, reps], h[g // 2:, reps]]).contiguous()


def _rotate_halves(xf: torch.Tensor, g: int) -> torch.Tensor:
    """``xf @ H_g`` per block as two half-size matmuls (fp32 ``[m, K]``, enough rows).

    Over the first half of a block (top digit 0, 1) the columns with top digit 1 and 3 repeat
    those with 0 and 2 (3 negated); over the second half 1 is -0 and 3 is 2. A BLAS that sums
    ``K = g`` as two sequential halves added at the end therefore gives the same bits from
    ``S1 +- S2`` with ``S1, S2`` computed for the 0 and 2 columns only.
    """
    m, k = xf.shape
    nb, q = m * (k // g), g // 4
    mats = _cached("halves", g, xf.device, _half_mats_cpu)
    xv = xf.reshape(nb, 2, g // 2)
    s1 = torch.matmul(xv[:, 0], mats[0]).view(nb, 2, q)
    s2 = torch.matmul(xv[:, 1], mats[1]).view(nb, 2, q)
    out = torch.empty((nb, 4, q), dtype=torch.float32, device=xf.device)
    torch.add(s1[:, 0], s2[:, 0], out=out[:, 0])
    torch.sub(s1[:, 0], s2[:, 0], out=out[:, 1])
    torch.add(s1[:, 1], s2[:, 1], out=out[:, 2])
    torch.sub(s2[:, 1], s1[:, 1], out=out[:, 3])
    return out.view(m, k)


_HALVES_OK: dict[tuple[int, str], bool] = {}
_PROBE_LOCK = threading.Lock()  # the one-time BLAS probes below


def halves_match_dense(g: int, device: torch.device | str = "cpu") -> bool:
    """Whether ``_rotate_halves`` reproduces ``rotate_dense`` bit for bit here (probed, cached)."""
    device = torch.device(device)
    key = (g, str(device))
    with _PROBE_LOCK:
        if key not in _HALVES_OK:
            ok = True
            gen = torch.Generator().manual_seed(g)
            for spread in (0.5, 3.0):
                if not ok:
                    break
                x = torch.randn(4 * DENSE_MIN_ROWS, g, generator=gen)
                x = (x * torch.exp(spread * torch.randn(x.shape, generator=gen))).to(device)
                x[:, ::5] *= -1e3
                ok = torch.equal(_rotate_halves(x, g), rotate_dense(x, g))
            _HALVES_OK[key] = ok
        return _HALVES_OK[key]


def rotate_exact(x: torch.Tensor, g: int) -> torch.Tensor:
    """``rotate_dense(x, g)`` bit for bit with half the flops where the BLAS allows it (~1.5x faster).

    Uses ``_rotate_halves`` when ``halves_match_dense`` confirms it on this device (MKL on x86
    sums ``K = 256`` as two sequential halves of 128), else ``rotate_dense`` itself.
    """
    _check_last_dim(x, g)
    if not halves_match_dense(g, x.device):
        return rotate_dense(x, g)
    xf, m = _as_rows(x, g)
    return _rotate_halves(xf, g)[:m].reshape(x.shape)


def _split(g: int) -> tuple[int, int]:
    """``g = a * b``, both powers of 4, ``b >= a`` (1x16, 4x16, 16x16, 16x64, ...)."""
    if g <= 16:
        return 1, g
    a = 4 ** ((g.bit_length() // 2) // 2)
    return a, g // a


def _rotate_mm_(src: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
    """CPU fast path on a contiguous fp32 ``[m, K]`` chunk: ``H_a X H_b`` per block, into ``out``."""
    a, b = _split(g)
    hb = hadamard(b, src.device)
    if a == 1:
        torch.matmul(src.view(-1, b), hb, out=out.view(-1, b))
        return out
    ha = hadamard(a, src.device)
    tmp = torch.matmul(src.view(-1, b), hb).view(-1, a, b)
    torch.matmul(ha, tmp, out=out.view(-1, a, b))
    return out


def _butterfly_(src: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
    """Elementwise path: log4(g) passes of the 4-point transform over a flat fp32 chunk.

    Per pass, along the digit with stride ``s``: ``y0 = (x0+x1)+(x2-x3)``, ``y1 = (x0+x1)-(x2-x3)``,
    ``y2 = (x0-x1)+(x2+x3)``, ``y3 = (x2+x3)-(x0-x1)`` (the columns of H4). ``src`` is clobbered.
    """
    n = src.numel()
    t = torch.empty(4, n // 4, dtype=src.dtype, device=src.device)
    bufs = (src.view(-1), out.view(-1))
    cur = 0
    s = g // 4
    while s >= 1:
        x0, x1, x2, x3 = bufs[cur].view(-1, 4, s).unbind(1)
        y0, y1, y2, y3 = bufs[1 - cur].view(-1, 4, s).unbind(1)
        p, q, r, w = (v.view(-1, s) for v in t.unbind(0))
        torch.add(x0, x1, out=p)
        torch.sub(x2, x3, out=q)
        torch.sub(x0, x1, out=r)
        torch.add(x2, x3, out=w)
        torch.add(p, q, out=y0)
        torch.sub(p, q, out=y1)
        torch.add(r, w, out=y2)
        torch.sub(w, r, out=y3)
        cur = 1 - cur
        s //= 4
    bufs[cur].mul_(1.0 / (g ** 0.5))  # exact: a power of two
    if cur == 0:
        out.view(-1).copy_(bufs[0])
    return out


def rotate_chunk_(
    x32: torch.Tensor, g: int, out: torch.Tensor, *, butterfly: bool | None = None
) -> torch.Tensor:
    """Fast rotation of a contiguous fp32 ``[m, K]`` chunk into ``out`` (``x32`` may be clobbered)."""
    if butterfly is None:
        butterfly = x32.device.type != "cpu"
    if butterfly:
        return _butterfly_(x32, g, out)
    return _rotate_mm_(x32, g, out)


def _group_major_mm(xf: torch.Tensor, g: int, group: int) -> torch.Tensor:
    """The fast path's two matmuls arranged to write ``[group, n * K / group]`` directly."""
    a, b = _split(g)
    t = torch.matmul(hadamard(b, xf.device).t(), xf.view(-1, b).t())  # [group, n * K / group]
    if a == 1:
        return t
    return torch.matmul(t.view(-1, a), hadamard(a, xf.device).t()).view(b, -1)


_GROUP_MAJOR_OK: dict[tuple[int, int, str], bool] = {}


def group_major_matches(g: int, group: int, device: torch.device | str = "cpu") -> bool:
    """Whether ``_group_major_mm`` reproduces ``rotate``'s values bit for bit here (the BLAS
    may sum a product of other operand layouts in another order); probed once, cached."""
    device = torch.device(device)
    key = (g, group, str(device))
    with _PROBE_LOCK:
        if key not in _GROUP_MAJOR_OK:
            gen = torch.Generator().manual_seed(g + group)
            x = torch.randn(8, 4 * g, generator=gen)
            x = (x * torch.exp(3.0 * torch.randn(x.shape, generator=gen))).to(device)
            want = rotate(x, g).reshape(-1, group).t()
            _GROUP_MAJOR_OK[key] = torch.equal(_group_major_mm(x, g, group), want)
        return _GROUP_MAJOR_OK[key]


def rotate_group_major(x: torch.Tensor, g: int, group: int) -> torch.Tensor:
    """``rotate(x, g)`` of ``[n, K]`` rows, returned group-major: ``[group, n * K / group]``,
    element ``[j, q]`` being column ``j`` of the ``q``-th run of ``group`` consecutive columns
    (``rotate(x, g).reshape(-1, group).t()``), the layout a per-group encoder works in.

    On CPU, when ``g = a * group`` with ``H_g = H_a (x) H_group`` (``_split``), the two matmuls
    of the fast path can write this layout directly, with no transposing copy of the result:
    used where ``group_major_matches`` confirms the same bits as ``rotate`` (MKL: g = 256 and
    16 with group 16), else ``rotate`` followed by the transpose.
    """
    _check_last_dim(x, g)
    if x.dim() == 2 and x.device.type == "cpu" and _split(g)[1] == group \
            and group_major_matches(g, group, x.device):
        return _group_major_mm(x.to(torch.float32).contiguous(), g, group)
    return rotate(x, g).reshape(-1, group).t().contiguous()


def rotate(x: torch.Tensor, g: int, *, butterfly: bool | None = None) -> torch.Tensor:
    """Blockwise ConvRot rotation of the last dim, fp32 result on ``x``'s device.

    Fast path (see module doc); agrees with ``rotate_dense`` to fp32 rounding. ``butterfly``
    forces the elementwise (True) or matmul (False) variant; default: matmul on CPU only.
    """
    _check_last_dim(x, g)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, k), dtype=torch.float32, device=x.device)
    step = max(1, CHUNK_ELEMS // k)
    for i in range(0, m, step):
        src = x2[i:i + step].to(torch.float32, copy=True).contiguous()
        rotate_chunk_(src, g, out[i:i + step], butterfly=butterfly)
    return out.reshape(*x.shape[:-1], k)
