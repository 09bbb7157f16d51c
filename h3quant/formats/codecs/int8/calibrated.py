"""int8_tensorwise with calibrated rounding: the scales of ``encode_int8``, codes by error feedback.

The per-row scale is chosen exactly as the uncalibrated encoder chooses it (``max|W_rot| / 127``
of the row, in the rotated basis when ConvRot is on); only the codes change. ``calibration`` is
any object with ``feedback(x, quantize, convrot=, group_size=)`` (``h3quant.calibration``'s
``LayerStats``): it walks the columns and asks ``quantize(v, j)`` for the nearest level of
column ``j``'s values, which here is ``clamp(round_half_even(v / s), -127, 127)`` - the very
arithmetic of round to nearest, so statistics that give no feedback (an identity Hessian)
reproduce the uncalibrated codes bit for bit. Codes never reach -128 (verify's row rule).
"""

from __future__ import annotations

import torch

from h3quant.formats.codecs.int8.tensors import (
    SCALE_MIN,
    _absmax_rows,
    _check_weight,
    _finite_or_raise,
    _rotation,
)


def encode_int8_calibrated(weight: torch.Tensor, calibration, *, convrot: bool = True,
                           group_size: int = 256, method: str = "exact"
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [N, K], scale f32 [N, 1])`` of float rows ``weight`` with calibrated codes."""
    _check_weight(weight, convrot, group_size, True)
    rot = _rotation(convrot, group_size, method)(weight.to(torch.float32, copy=True))
    a = _absmax_rows(rot)
    _finite_or_raise(a, 0)
    s = (a / 127.0).clamp_(min=SCALE_MIN)
    s1 = s.reshape(-1)

    def quantize(v: torch.Tensor, j: int):
        c = (v / s1).round_().clamp_(-127.0, 127.0)
        return c, c * s1

    codes = calibration.feedback(rot, quantize, convrot=convrot, group_size=group_size)
    return codes.to(torch.int8), s


__all__ = ["encode_int8_calibrated"]
