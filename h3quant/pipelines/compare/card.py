"""The card: one record per file (and the reference), the ranking, and the JSON form."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from h3quant.pipelines.compare.facts import FileFacts
from h3quant.pipelines.metrics import json_safe


@dataclass
class Metric:
    sqnr_db: float
    rel_err: float
    cosine: float
    psnr_db: float | None = None


@dataclass
class BlockDrift:
    block: int
    sqnr_db: float  # the hidden state after this block (the file's own state so far)
    local_sqnr_db: float  # this block's residual update alone, on the reference's input


@dataclass
class StepDrift:
    step: int
    sigma: float
    heads: list[int] | None  # [start, stop) of a bank of output heads
    video_sqnr_db: float
    audio_sqnr_db: float
    seconds: float


@dataclass
class FileCard:
    facts: FileFacts
    role: str  # "reference" or "file"
    outputs: dict[str, Metric] = field(default_factory=dict)  # video, audio (one forward)
    drift: list[BlockDrift] = field(default_factory=list)
    final: dict[str, Metric] = field(default_factory=dict)  # the sampling run's final latents
    steps: list[StepDrift] = field(default_factory=list)
    step_seconds: float | None = None  # mean time of one sampler step on the device
    rank: int | None = None
    notes: list[str] = field(default_factory=list)
    # why the file fails (validate --deep's data findings, non-finite outputs): ranked last
    failures: list[str] = field(default_factory=list)
    # the fresh plain encode of the reference in this file's formats (pipelines.fresh_encode):
    # {"what": text, "outputs": {stream: dB}, "blocks": {block: alone dB}}; None: not made
    expected: dict | None = None
    # what is clearly worse than that encode (or, without one, below the fixed limits): the
    # block or output and both figures; a flagged file never ranks above an unflagged one
    flags: list[str] = field(default_factory=list)
    tie: bool = False  # within the measured noise floor of the file ranked just above it

    @property
    def limiting_stream(self) -> str | None:
        """The worse of the one-forward video and audio outputs (the one the file is ranked by)."""
        if not self.outputs:
            return None
        return min(self.outputs, key=lambda k: (_order(self.outputs[k].sqnr_db), k))

    @property
    def quality_db(self) -> float | None:
        """What the files are ranked by: the one-forward output SQNR of the limiting stream
        (the worse of video and audio)."""
        s = self.limiting_stream
        return None if s is None else self.outputs[s].sqnr_db

    @property
    def suspect_block(self) -> int | None:
        """The block that hurts most on its own (lowest local SQNR)."""
        if not self.drift:
            return None
        return min(self.drift, key=lambda d: (d.local_sqnr_db, d.block)).block

    def to_dict(self) -> dict:
        return {
            **self.facts.to_dict(), "role": self.role, "rank": self.rank,
            "quality_db": self.quality_db, "limiting_stream": self.limiting_stream,
            "suspect_block": self.suspect_block, "tie": self.tie,
            "expected": self.expected, "flags": self.flags,
            "outputs": {k: asdict(v) for k, v in self.outputs.items()},
            "final_latent": {k: asdict(v) for k, v in self.final.items()},
            "drift": [asdict(d) for d in self.drift],
            "steps": [asdict(s) for s in self.steps],
            "step_seconds": self.step_seconds, "notes": self.notes,
            "failures": self.failures,
        }


@dataclass
class CompareResult:
    reference: FileCard
    files: list[FileCard]
    reference_chosen: bool  # True: the reference was not named, the most precise file was taken
    run: dict  # inputs, seed, schedule, device, dtype, h3quant version: enough to rerun it
    notes: list[str] = field(default_factory=list)
    # the planner's predicted frontier over the float reference (plan.frontier.Point dicts,
    # smallest first); None when it was not drawn
    frontier: list[dict] | None = None
    # the reference against itself (1-ulp input perturbation; the device's compute dtype
    # against float32 where they differ): {"video": dB, "audio": dB, "how": [...]}
    floor: dict | None = None

    def ranked(self) -> list[FileCard]:
        return sorted(self.files, key=lambda c: (bool(c.failures), c.rank or math.inf))

    @property
    def failed(self) -> list[FileCard]:
        """The files that fail (data findings or non-finite outputs): compare exits 1."""
        return [c for c in self.files if c.failures]

    def to_dict(self) -> dict:
        """One record per file (the reference first), each carrying the run's settings."""
        records = []
        for c in [self.reference] + self.ranked():
            records.append({**c.to_dict(), "reference": self.reference.facts.path,
                            "reference_chosen": self.reference_chosen, "run": self.run})
        out: dict = {"records": records, "notes": self.notes, "noise_floor": self.floor}
        if self.frontier is not None:
            out["frontier"] = self.frontier
        return json_safe(out)


def _order(x: float) -> float:
    return -math.inf if x is None or math.isnan(x) else x


def tie_db(q: float, floor_db: float | None) -> float:
    """How far noise at the floor can move a file's measured SQNR ``q``: an error of relative
    size 10^(-q/20) with noise of size 10^(-floor/20) added measures between the two sums' dB."""
    if floor_db is None or not math.isfinite(q) or not math.isfinite(floor_db):
        return 0.0
    return 20.0 * math.log10(1.0 + 10.0 ** ((q - floor_db) / 20.0))


def rank(cards: list[FileCard], floor_db: float | None = None) -> None:
    """Rank 1 = the best. Files without a flag come first, then flagged files, then failing
    ones (data findings, outputs not finite: they also make compare exit 1); within each
    group by the limiting stream's one-forward SQNR, higher first. Two neighbours whose
    difference the noise floor (``floor_db``, the limiting stream's) can explain are a tie:
    the same rank, ``tie`` set on the second."""
    for c in cards:
        q = c.quality_db
        if q is not None and (math.isnan(q) or q == -math.inf) and not c.failures:
            c.failures.append(f"its outputs are NaN or infinite (quality {q} dB)")

    def key(c: FileCard):
        q = c.quality_db
        return (2 if c.failures else (1 if c.flags else 0),
                -(q if q is not None and not math.isnan(q) else -math.inf))

    prev = None
    for i, c in enumerate(sorted(cards, key=key)):
        c.rank, c.tie = i + 1, False
        if prev is not None and not c.failures and key(prev)[0] == key(c)[0]:
            a, b = prev.quality_db, c.quality_db
            if (a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
                    and abs(a - b) <= tie_db(a, floor_db) + tie_db(b, floor_db)):
                c.rank, c.tie = prev.rank, True
        prev = c
