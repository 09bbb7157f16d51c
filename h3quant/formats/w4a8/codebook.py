"""W4A8 level tables: the frozen Lloyd-Max table, k-means fitting, and the choice between them.

All functions work on ConvRot-rotated weights whose groups are normalised by their abs-max, so
values lie in [-1, 1].
"""

from __future__ import annotations

import torch

# Lloyd-Max levels for a group-abs-max-normalised Gaussian (FORMATS.md section 4).
FROZEN_CODEBOOK = torch.tensor(
    [
        -0.980602, -0.794529, -0.638165, -0.500986, -0.377321, -0.263187, -0.155210, -0.050720,
        0.052541, 0.156985, 0.265284, 0.379533, 0.502636, 0.638953, 0.794876, 0.980671,
    ],
    dtype=torch.float32,
)

# "auto" fits a table only when it pays: both tables run the continuous step of the encoder
# (nearest level + ALS group scales) on a deterministic row sample, and the fitted table wins
# when it lowers the sample's relative L2 error by at least FIT_MIN_GAIN (relative). Kurtosis
# does not work here: after H_256 an outlier column spreads evenly over its block, so
# outlier-heavy layers show LOWER (more negative) kurtosis than Gaussian ones (excess kurtosis
# of the normalised values: Gaussian -0.49, Student-t3 -0.55, 1% columns x30 -0.97, 8 columns
# x100 -1.43), so kitchen's "fit when kurtosis > -0.1" gate never fires on them. Measured gains of
# the fitted table ([512, 2048]): 8 columns x100 13% (fit), 1% columns x30 2%, Student-t2 1%,
# Gaussian -0.5% (frozen). The margin keeps Gaussian-like layers on the frozen table, the one
# kitchen's CUDA GEMV kernel has built in.
FIT_MIN_GAIN = 0.03
ALS_PASSES = 2
SAMPLE_ELEMS = 1 << 20  # values sampled for the decision and the fit
_KMEANS_ITERS = 30


def level_midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """Decision boundaries between consecutive sorted levels (15 values)."""
    return (codebook[:-1] + codebook[1:]) * 0.5


def decoded_levels(table: torch.Tensor, s_rel: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` int8 levels (as fp32) of group scales ``s_rel`` [...]: the decoder's
    arithmetic, the fp32 product of codebook ``table`` [16] and the scale, rounded half to even
    and clamped to +-127."""
    return (table * s_rel.unsqueeze(-1)).round_().clamp_(-127, 127)


def take(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` through index_select (several times faster than advanced indexing on CPU)."""
    return torch.index_select(table, 0, idx.reshape(-1)).view(idx.shape)


class LevelIndex:
    """Exact nearest-level lookup for a sorted 16-level table, without a binary search per value.

    A uniform grid of ``bins`` cells over [-1, 1] gives each value a lower bound on the number of
    midpoints below it; ``steps`` compare-and-step rounds then reach the exact count (one round for
    any table whose midpoints are further apart than a cell, e.g. the frozen one). Values beyond
    [-1, 1] land in the end cells. Ties go to the lower level, like ``torch.bucketize``.
    """

    def __init__(self, table: torch.Tensor, bins: int = 4096) -> None:
        self.table = table.float().contiguous()
        dev = self.table.device
        mids = level_midpoints(self.table.double())
        inf = torch.tensor([float("inf")], dtype=torch.float64, device=dev)
        self.mids_ext = torch.cat([mids, inf]).float()  # index 15 -> never stepped past
        self.bins = bins
        margin = 0.125 * 2.0 / bins  # guards fp32 rounding of the cell index
        lo = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64, device=dev)
        lo_edges, hi_edges = lo[:-1] - margin, lo[1:] + margin
        lo_edges[0], hi_edges[-1] = -float("inf"), float("inf")
        self.lut = torch.searchsorted(mids, lo_edges).to(torch.int32)  # count(mids < lo edge)
        self.steps = int((torch.searchsorted(mids, hi_edges) - self.lut).max())

    def nearest(self, u: torch.Tensor) -> torch.Tensor:
        """int32 index of the nearest level for every value of ``u`` (finite float32)."""
        half = self.bins * 0.5
        cell = u.mul(half).add_(half).clamp_(0, self.bins - 1).to(torch.int32)
        codes = take(self.lut, cell)
        for _ in range(self.steps):  # int arithmetic: bool-mask kernels are slow on CPU
            codes.add_(torch.gt(u, take(self.mids_ext, codes)))
        return codes


def sample_rows(x: torch.Tensor, max_elems: int = SAMPLE_ELEMS) -> torch.Tensor:
    """Evenly strided rows of a 2-D tensor, about ``max_elems`` values, independent of chunking."""
    n, k = x.shape
    rows = max(1, min(n, max_elems // max(k, 1)))
    if rows == n:
        return x
    idx = torch.linspace(0, n - 1, rows, dtype=torch.float64).round().long().to(x.device)
    return x.index_select(0, idx)


def normalise_groups(rotated: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rotated rows [n, K] -> values divided by their group abs-max, flattened; zero groups dropped."""
    g = rotated.reshape(-1, group_size)
    amax = g.abs().amax(dim=1, keepdim=True)
    keep = amax.squeeze(1) > 0
    return (g[keep] / amax[keep]).reshape(-1)


def als_group_scales(gx: torch.Tensor, table, passes: int = ALS_PASSES, *, codes: bool = True):
    """Continuous step for groups ``gx`` [..., G]: nearest level of the abs-max-normalised group,
    then ``passes`` alternating least-squares rounds (scale = <x, l> / <l, l>, reassign).

    ``table``: a sorted [16] tensor or its ``LevelIndex``.
    Returns (codes int32 [..., G], scale [..., 1] > 0, zero [..., 1] bool for all-zero groups).
    With ``codes=False`` the last assignment is not made for every weight: the nearest level is
    monotone in the value, so the group's largest ``|level|`` comes from its smallest and
    largest values alone; returns (scale, zero, reach = largest |level| * scale [..., 1]).
    """
    index = table if isinstance(table, LevelIndex) else LevelIndex(table)
    lo, hi = torch.aminmax(gx, dim=-1, keepdim=True)
    scale = torch.maximum(lo.neg(), hi)
    zero = scale == 0
    scale = scale.masked_fill(zero, 1.0)
    idx = index.nearest(gx / scale)
    tiny = torch.finfo(torch.float32).tiny
    for p in range(passes):
        lv = take(index.table, idx)
        num = (gx * lv).sum(-1, keepdim=True)
        den = lv.mul_(lv).sum(-1, keepdim=True).clamp_(min=tiny)
        new = num.div_(den)
        scale = torch.where((new > 0) & ~zero, new, scale)
        if codes or p < passes - 1:
            idx = index.nearest(gx / scale)
    if codes:
        return idx, scale, zero
    ends = index.table.index_select(0, index.nearest(torch.cat([lo / scale, hi / scale], -1)).view(-1))
    reach = ends.view(lo.shape[:-1] + (2,)).abs_().amax(-1, keepdim=True).mul_(scale)
    return scale, zero, reach


def als_error(rotated: torch.Tensor, group_size: int, table: torch.Tensor) -> float:
    """Relative L2 error of the continuous step (no e4m3, no int8 grid) on rotated rows."""
    gx = rotated.reshape(-1, group_size)
    codes, scale, zero = als_group_scales(gx, table)
    approx = (take(table, codes) * scale).masked_fill(zero, 0.0)
    den = gx.double().norm().item()
    return (gx - approx).double().norm().item() / den if den > 0 else 0.0


def sort_floats(u: torch.Tensor) -> torch.Tensor:
    """Ascending sort of finite float32 values through their int32 bit patterns (monotone keys:
    negatives' magnitude bits flipped), where torch sorts integers several times faster than
    floats (radix sort). The same values in the same order as ``u.sort()`` (-0.0 before 0.0)."""
    b = u.contiguous().view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    s = torch.sort(key, stable=True).values
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).view(torch.float32)


def fit_codebook(u: torch.Tensor, iters: int = _KMEANS_ITERS) -> torch.Tensor:
    """1-D k-means (Lloyd) with 16 levels on normalised values, started from the frozen table.

    The values are sorted once, so each round is 15 binary searches plus prefix-sum differences.
    Returns a sorted float32 table clamped to [-1, 1]; an empty level keeps its previous value.
    """
    u = sort_floats(u.reshape(-1).float()).double()
    if u.numel() == 0:
        return FROZEN_CODEBOOK.to(u.device)
    csum = torch.cat([torch.zeros(1, dtype=torch.float64, device=u.device), u.cumsum(0)])
    levels = FROZEN_CODEBOOK.to(u.device).double()
    for _ in range(iters):
        # values <= midpoint j belong to levels 0..j (ties to the lower level)
        ends = torch.searchsorted(u, level_midpoints(levels), right=True)
        bounds = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), u.numel())])
        counts = (bounds[1:] - bounds[:-1]).double()
        sums = csum[bounds[1:]] - csum[bounds[:-1]]
        new = torch.where(counts > 0, sums / counts.clamp(min=1), levels).sort().values
        if torch.equal(new, levels):
            break
        levels = new
    return levels.float().clamp(-1.0, 1.0).contiguous()


def choose_codebook(sample_rotated: torch.Tensor, group_size: int, mode: str) -> tuple[torch.Tensor, bool]:
    """(table, fitted) for ``mode`` in {"auto", "frozen", "fit"} from rotated sample rows."""
    frozen = FROZEN_CODEBOOK.to(sample_rotated.device, copy=True)  # never hand out the constant
    if mode == "frozen":
        return frozen, False
    fitted = fit_codebook(normalise_groups(sample_rotated, group_size))
    if mode == "fit":
        return fitted, True
    frozen_err = als_error(sample_rotated, group_size, frozen)
    fitted_err = als_error(sample_rotated, group_size, fitted)
    if fitted_err <= frozen_err * (1.0 - FIT_MIN_GAIN):
        return fitted, True
    return frozen, False


CODEBOOK_LEVELS = 16


def codebook_violation(levels: torch.Tensor):
    """A W4A8 codebook must hold 16 finite levels in [-1, 1], sorted ascending (D104). The
    encoder's nearest-level search and the decoders assume it; convert and verify refuse a
    layer that breaks it, validate --deep reports it (through the codec's ``data_violation``)."""
    from h3quant.formats.spec import Violation

    levels = levels.float().reshape(-1)
    problems = []
    if levels.numel() != CODEBOOK_LEVELS:
        problems.append(f"{levels.numel()} levels (expected {CODEBOOK_LEVELS})")
    finite = bool(torch.isfinite(levels).all())
    if not finite:
        problems.append("non-finite levels")
    elif levels.numel() and (levels.abs() > 1).any():
        problems.append(f"levels outside [-1, 1] (max |level| {levels.abs().max().item():.6g})")
    if levels.numel() > 1 and finite and (levels[1:] < levels[:-1]).any():
        problems.append("levels not sorted ascending")
    if not problems:
        return None
    return Violation("D104", "codebook has " + ", ".join(problems) + "; expected 16 sorted "
                     "finite levels in [-1, 1]", "weight_codebook")
