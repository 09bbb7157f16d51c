"""The packed sequence of the plain text-to-video+audio case (FORMATS.md 5.1): row order,
3-axis RoPE positions, the two timesteps and the adaLN row of every segment.

Rows are ``[text (L) | audio (2 * Ta) | video (T * H/2 * W/2)]``.

Positions ``(t, h, w)`` (float64 here, fp32 when turned into angles):
- text row ``j``: ``(j, 0, 0)``;
- the video frame grid: ``h`` and ``w`` are "area normalised": for an axis of ``n`` latent
  pixels (``n / 2`` patches) and ``area = sqrt(H * W)``, ``ratio = n / area`` and patch ``i`` sits
  at ``32 * ((1 - ratio) / 2 + i * ratio / (n / 2))``;
- video frame ``f`` starts at ``t = L + sum_{g < f} 5/3 * (1, 4, 4, 4, 4)[g % 5]``;
- audio frame ``f`` of stereo channel ``c``: ``t = L + f``, ``h = 0``, ``w`` = the first (c = 0)
  or last (c = 1) value of the video ``w`` axis.

Timesteps: ``t_video = 1 - sigma``; ``t_audio = 1 - shift(sigma, 12 -> 3)``. The distinct values,
sorted, index the time embeddings; a segment's adaLN row is ``3 * index(t) + modality`` with
modality video 0, text 1, audio 2 (text uses the video timestep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h3quant.errors import VerifyError
from h3quant.runtime.model.ops import Segment

VIDEO, TEXT, AUDIO = 0, 1, 2
MODALITIES = 3
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0
FRAME_SPANS = (1, 4, 4, 4, 4)
FRAME_SCALE = 5.0 / 3.0
GRID_SCALE = 32.0
SIGMA_MIN = 1e-6


def time_shift(sigma: float, a: float, b: float) -> float:
    """Map a sigma of the schedule shifted by ``a`` to the schedule shifted by ``b``."""
    u = sigma / (a + sigma * (1.0 - a))
    return b * u / (1.0 + (b - 1.0) * u)


@dataclass(frozen=True)
class Timesteps:
    sigma: float
    video: float
    audio: float
    values: tuple[float, ...]  # distinct timesteps, sorted: row i of the time embedding

    @classmethod
    def from_sigma(cls, sigma: float) -> "Timesteps":
        if not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or not 0 < sigma <= 1:
            raise VerifyError(f"sigma must be in (0, 1], got {sigma!r}")
        s = max(float(sigma), SIGMA_MIN)
        tv, ta = 1.0 - s, 1.0 - time_shift(s, VIDEO_SHIFT, AUDIO_SHIFT)
        return cls(s, tv, ta, tuple(sorted({tv, ta})))

    def index(self, t: float) -> int:
        return self.values.index(t)


def _axis(n: int, area: float) -> torch.Tensor:
    """Area-normalised patch coordinates of one axis of ``n`` latent pixels (n / 2 patches)."""
    patches = n // 2
    ratio = n / area
    i = torch.arange(patches, dtype=torch.float64)
    return ((1.0 - ratio) / 2.0 + i * (ratio / patches)) * GRID_SCALE


@dataclass(frozen=True)
class PackedLayout:
    """Row structure of one call: ``segments`` are (start, stop, kind) with kind text/audio/video."""

    text: int
    frames: int  # latent frames T
    height: int  # latent height, padded to even
    width: int  # latent width, padded to even
    audio_frames: int
    positions: torch.Tensor  # [S, 3] float64

    @classmethod
    def t2va(cls, text: int, frames: int, height: int, width: int,
             audio_frames: int) -> "PackedLayout":
        for name, v in (("text tokens", text), ("frames", frames), ("height", height),
                        ("width", width), ("audio frames", audio_frames)):
            if not isinstance(v, int) or v < 1:
                raise VerifyError(f"{name} must be a positive integer, got {v!r}")
        if height % 2 or width % 2:
            raise VerifyError(f"latent height and width must be even (patch 1x2x2), got "
                              f"{height}x{width}")
        area = math.sqrt(height * width)
        hh, ww = torch.meshgrid(_axis(height, area), _axis(width, area), indexing="ij")
        frame = torch.stack((hh.reshape(-1), ww.reshape(-1)), dim=-1)  # [h*w, 2]
        w_axis = _axis(width, area)
        pos_text = torch.zeros(text, 3, dtype=torch.float64)
        pos_text[:, 0] = torch.arange(text, dtype=torch.float64)
        pos_audio = torch.zeros(2 * audio_frames, 3, dtype=torch.float64)
        pos_audio[:, 0] = (text + torch.arange(audio_frames, dtype=torch.float64)).repeat(2)
        pos_audio[:audio_frames, 2] = float(w_axis[0])
        pos_audio[audio_frames:, 2] = float(w_axis[-1])
        spans = [FRAME_SCALE * FRAME_SPANS[f % 5] for f in range(frames)]
        starts = [float(text)]
        for span in spans[:-1]:
            starts.append(starts[-1] + span)
        pos_video = torch.empty(frames, frame.shape[0], 3, dtype=torch.float64)
        pos_video[:, :, 0] = torch.tensor(starts, dtype=torch.float64)[:, None]
        pos_video[:, :, 1:] = frame[None]
        positions = torch.cat((pos_text, pos_audio, pos_video.reshape(-1, 3)))
        return cls(text, frames, height, width, audio_frames, positions)

    @property
    def video_rows(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)

    @property
    def rows(self) -> int:
        return self.text + 2 * self.audio_frames + self.video_rows

    @property
    def segments(self) -> list[tuple[int, int, str]]:
        a = self.text
        v = a + 2 * self.audio_frames
        return [(0, a, "text"), (a, v, "audio"), (v, self.rows, "video")]

    def span(self, kind: str) -> tuple[int, int]:
        return next((a, b) for a, b, k in self.segments if k == kind)

    def mod_segments(self, ts: Timesteps) -> list[Segment]:
        """(start, stop, adaLN row) of every segment for the block modulation."""
        row = {"text": MODALITIES * ts.index(ts.video) + TEXT,
               "audio": MODALITIES * ts.index(ts.audio) + AUDIO,
               "video": MODALITIES * ts.index(ts.video) + VIDEO}
        return [(a, b, row[k]) for a, b, k in self.segments if b > a]


def layout_for_rows(rows: int) -> PackedLayout:
    """A small t2va layout of exactly ``rows`` rows (a quarter text, an eighth audio and the
    rest video in one frame of one patch row): the per-block verify feeds its seeded hidden
    states through the real segment / position structure."""
    if rows < 4:
        raise VerifyError(f"a packed sequence needs at least 4 rows, got {rows}")
    text = max(1, rows // 4)
    audio = max(1, rows // 16)
    video = rows - text - 2 * audio
    return PackedLayout.t2va(text, 1, 2, 2 * video, audio)
