"""The documented limits on every size a header or an option can name.

Each is checked before any work (a usage error, exit 2, or for a header a finding, exit 1), so
no value can make a command allocate without bound. ``--help`` of each command states them.

* ``MAX_BLOCKS`` (1000): DiT or refiner blocks, as an option (``--blocks``, ``--depth``) or as a
  block index in a header (finding T106 at index 1000 and beyond). H3 has 50.
* ``MAX_TOKENS`` (16384): per-block verify's ``--tokens``, and ``--text-tokens``.
* ``MAX_MODEL_ROWS`` (16384): the packed sequence of ``verify --model``: text tokens + 2 x audio
  frames + video tokens (frames x ceil(height / 2) x ceil(width / 2)). Attention runs in bounded
  score blocks, so memory grows with rows x width, never rows squared. At the limit a run is
  the costliest a user can ask for: about 60 s and 2.3 GB on the tiny synthetic model on a
  quiet machine (more at full width).
* ``MAX_AUDIO_FRAMES`` (8192): ``--audio-frames`` (2 rows each).
* ``MAX_WORKERS`` (64): convert's ``--workers``. W4A8 encodes at most 16 row chunks at once
  whatever the count, so its working memory does not grow with more workers.
* ``MAX_JSON_BYTES`` (16 MiB): a JSON file a command reads (``convert --recipe``, ``plan
  --from``, a card or calibration statistics). Only a regular file is read (a FIFO or a device
  such as ``/dev/zero`` is refused from ``stat``), and never more than this.
* ``MAX_LORA_RANK`` (1024): the rank of one LoRA adapter (``convert --lora``), checked from the
  file's header before any tensor is read. Every adapter tensor must also fit its layer, so a
  LoRA's data read is bounded by (rows + columns) x rank per layer; tensors of a LoRA file that
  are no part of an adapter are never read.
* ``MAX_PATTERN_CHARS`` (65536): a user-written regular expression (``--layer``,
  ``--include``, ``--exclude``, a recipe rule; a planner's per-layer recipe for the whole model
  is about 10,000). Backreferences, lookarounds and inline flags are refused as usage errors
  naming the rule; every other pattern is matched in time linear in the name's length
  (``h3quant.patterns``), so ``(.|.|.|.)*Z$`` takes microseconds.
* ``MAX_SQNR_DB`` (300): a quality target in dB (``plan --target-sqnr``, ``--targets``): fp32
  rounding itself is about 150 dB; the range is [-300, 300].
* ``MAX_GGUF_METADATA_VALUES`` (65536): a GGUF header's metadata fields and their array
  elements, all told. The header is walked by h3quant first (every count and length against
  the bytes left in the file and these limits) before the gguf package reads it, which builds a
  Python object per element: at the limit it takes about a second. An H3 GGUF from
  ComfyUI-GGUF holds a few dozen.
* ``MAX_GGUF_TENSORS`` (65536): tensors a GGUF header may describe (H3 has about 1,500).
"""

from __future__ import annotations

from h3quant.errors import UsageError

MAX_BLOCKS = 1000
MAX_TOKENS = 16384
MAX_MODEL_ROWS = 16384
MAX_AUDIO_FRAMES = MAX_MODEL_ROWS // 2
MAX_WORKERS = 64
MAX_JSON_BYTES = 16 << 20
MAX_LORA_RANK = 1024
MAX_PATTERN_CHARS = 65536
MAX_SQNR_DB = 300.0
MAX_GGUF_METADATA_VALUES = 1 << 16
MAX_GGUF_TENSORS = 1 << 16


def model_rows(frames: int, height: int, width: int, audio_frames: int, text_tokens: int) -> int:
    """Rows of the packed sequence ``verify --model`` builds (odd sizes padded to the patch)."""
    return text_tokens + 2 * audio_frames + frames * (-(-height // 2)) * (-(-width // 2))


def check_model_rows(frames: int, height: int, width: int, audio_frames: int,
                     text_tokens: int) -> int:
    """The packed rows of these inputs, or ``UsageError`` when they exceed ``MAX_MODEL_ROWS``."""
    rows = model_rows(frames, height, width, audio_frames, text_tokens)
    if rows > MAX_MODEL_ROWS:
        video = rows - text_tokens - 2 * audio_frames
        raise UsageError(f"the whole-model inputs make {rows:,} sequence rows (video {frames} x "
                         f"{-(-height // 2)} x {-(-width // 2)} = {video:,}, audio "
                         f"2 x {audio_frames}, text {text_tokens}); the limit is "
                         f"{MAX_MODEL_ROWS:,}: lower --frames, --height, --width, "
                         "--audio-frames or --text-tokens")
    return rows
