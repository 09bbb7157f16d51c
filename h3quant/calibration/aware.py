"""Activation-aware error feedback: the statistics of the inputs as the runtime rounds them.

A format whose runtime path quantizes a layer's inputs (INT4 ConvRot: rotated, int4 per token;
W4A8 and INT8 ConvRot: rotated, int8 per token; plain INT8: int8 per token) computes
``Xq Wq^T``, and error feedback then needs ``Hq = Xq^T Xq`` and the cross term ``C = X^T Xq``
(``calibration.gptq``, ``aware_target``) in the basis the codes are chosen in.

Writing both ``K x K`` matrices per format into the statistics file would triple its size and
tie it to one format, so they are modelled from what a version 2 file holds: the exact ``H``
over every row, and the sampled rows. Each rounded channel is its input times a gain plus
noise, ``xq_j = a_j x_j + e_j``, the noise uncorrelated with the inputs and between channels
(per-token rounding errors of different channels have independent signs; what is not
independent, such as a channel that mostly rounds to zero or the token maximum that is never
rounded, is the gain). Then

    C = H diag(a),    Hq = diag(a) H diag(a) + diag(v),

with ``a_j = sum x_j xq_j / sum x_j^2`` and the noise energy ``v_j = H_jj sum e_j^2 / sum x_j^2``
measured on the sampled rows by the format's own activation path (``input_rounding``), and ``H``
exact. ``Hq`` is positive semi-definite by construction (a few hundred sampled rows would make a
full ``D^T D`` estimate rank-deficient and noisy). Sampled rows the runtime leaves as they are
give ``a = 1``, ``v = 0``: ``C == Hq == H`` and the plain feedback's codes bit for bit. A
version 1 file has no sampled rows: its layers keep the plain feedback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h3quant.calibration.gptq import gains_and_noise

Rounding = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def input_rounding(codec, marker: dict | None,
                   capability: tuple[int, int] | None = None) -> Rounding | None:
    """``x [S, K] fp32 -> (x in the codes' basis, x as the runtime rounds it)`` for a layer of
    ``codec`` / ``marker`` on the runtime's default CPU path, or None where that path keeps the
    activations in float (the formats run through their float decode). The dispatch is
    ``smooth.runtime_output``'s: comfy-kitchen's emulated forward where ComfyUI runs one on the
    CPU (INT4 ConvRot), the float decode, else the int8 grid with per-token int8 inputs.
    ``capability``: for a format whose codec routes by the GPU (``kernel_route``), the rounding
    of kitchen's kernels on a GPU of that compute capability instead (INT4 ConvRot with
    ``linear_dtype: int8``: int8 per token). Such a layer is modelled on that route even without
    ``capability``: its marker changes nothing on the CPU path, and every GPU kernel multiplies
    int8 activations for it."""
    fields = marker or {}
    if capability is None and fields.get("linear_dtype") == "int8":
        capability = (8, 0)
    if capability is not None and hasattr(codec.emulator, "kernel_route"):
        return lambda x: codec.emulator.rounded_inputs(x.to(torch.float32), fields, capability)
    emulation = codec.spec.runtime.emulation
    if emulation is not None and "cpu" in emulation[1] and hasattr(codec.emulator, "rounded_inputs"):
        return lambda x: codec.emulator.rounded_inputs(x.to(torch.float32), fields)
    if codec.spec.runtime.decodes and hasattr(codec.decoder, "decode_weight"):
        return None
    from h3quant.runtime.int8_math import quantize_activation, rotate_activation

    convrot = codec.spec.reading.uses_convrot(marker)
    g = int(fields.get("convrot_groupsize", 256))

    def rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(torch.float32)
        q, s = quantize_activation(x, convrot, g)
        return rotate_activation(x, convrot, g), q.to(torch.float32) * s.reshape(-1, 1)

    return rounding


__all__ = ["Rounding", "gains_and_noise", "input_rounding"]
