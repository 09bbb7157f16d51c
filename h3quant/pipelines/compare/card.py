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
    # why the file fails (validate --deep's data findings, non-finite outputs): never ranked
    failures: list[str] = field(default_factory=list)

    @property
    def quality_db(self) -> float | None:
        """What the files are ranked by: the lower of the final video / audio latent SQNR
        (the one-forward output SQNR without a sampling run)."""
        src = self.final or self.outputs
        vals = [m.sqnr_db for m in src.values()]
        return min(vals) if vals else None

    @property
    def suspect_block(self) -> int | None:
        """The block that hurts most on its own (lowest local SQNR)."""
        if not self.drift:
            return None
        return min(self.drift, key=lambda d: (d.local_sqnr_db, d.block)).block

    def to_dict(self) -> dict:
        return {
            **self.facts.to_dict(), "role": self.role, "rank": self.rank,
            "quality_db": self.quality_db, "suspect_block": self.suspect_block,
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

    def ranked(self) -> list[FileCard]:
        return sorted(self.files, key=lambda c: (c.rank or math.inf))

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
        out: dict = {"records": records, "notes": self.notes}
        if self.frontier is not None:
            out["frontier"] = self.frontier
        return json_safe(out)


def rank(cards: list[FileCard]) -> None:
    """Rank 1 = the highest quality. A file whose quality is NaN or -inf (its outputs are not
    finite) fails and, like every failing file, gets no rank."""
    for c in cards:
        q = c.quality_db
        if q is not None and (math.isnan(q) or q == -math.inf) and not c.failures:
            c.failures.append(f"its outputs are NaN or infinite (quality {q} dB)")

    def key(c: FileCard):
        q = c.quality_db
        return -(q if q is not None else -math.inf)

    ok = [c for c in cards if not c.failures]
    for i, c in enumerate(sorted(ok, key=key)):
        c.rank = i + 1
