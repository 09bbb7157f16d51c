"""Seeded inputs files for the calibration tests: video, audio and text of 256 packed rows each."""

from pathlib import Path

import torch

from h3quant.calibration.recorder import write_inputs


def input_dims(src: Path) -> dict[str, int]:
    """The channel widths an inputs file for checkpoint ``src`` must have."""
    from h3quant.runtime.model.model import H3Model

    with H3Model.open(src) as m:
        return {"vc": m.video_channels, "ac": m.audio_channels, "td": m.text_dim}


def seeded_inputs(d: Path, dims: dict[str, int], seeds) -> list[Path]:
    """One inputs file ``d/in{seed}.safetensors`` per seed (2 x 16 x 16 video latents, 2 x 32
    audio, 64 text tokens; sigma between 0.25 and 0.85)."""
    out = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        p = d / f"in{s}.safetensors"
        write_inputs(p, torch.randn(1, dims["vc"], 2, 16, 16, generator=g),
                     torch.randn(1, dims["ac"], 2, 32, generator=g),
                     torch.randn(1, 64, dims["td"], generator=g), 0.25 + 0.1 * (s % 7),
                     {"seed": str(s)})
        out.append(p)
    return out


def synth_world(d: Path, seed: int, calls: int) -> dict:
    """A tiny 2-block synthetic checkpoint ``d/bf16.safetensors`` (``seed``) and ``calls``
    seeded inputs files in ``d/calib``: ``{"d", "src", "inputs", "calib"}``."""
    from h3quant.synth import synth_checkpoint

    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=seed)
    (d / "calib").mkdir()
    ins = seeded_inputs(d / "calib", input_dims(src), range(calls))
    return {"d": d, "src": src, "inputs": ins, "calib": str(d / "calib")}
