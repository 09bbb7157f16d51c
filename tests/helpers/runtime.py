"""Small helpers shared by the runtime tests: an independent weight quantizer and an error."""

import torch

from h3quant.convrot import rotate


def quantize_weight(w, convrot=True, g=256):
    """Per-row int8 (ConvRot when ``convrot``), written plainly as FORMATS.md 3 states it."""
    wr = rotate(w, g) if convrot else w.float()
    s = (wr.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30)
    return torch.round(wr / s).clamp(-128, 127).to(torch.int8), s


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
