"""``verify --tp N --reference FLOAT``: the sharded run is checked in two steps that together say
how it compares with the float checkpoint.

1. the tensor-parallel checks (``pipelines.verify.tp``): the sharded blocks compute what the same
   blocks compute on one device (bit for bit with the shared scale, within the per-rank
   tolerance otherwise);
2. the ordinary single-device verify against the float reference (``verify_checkpoint`` per
   block, ``verify_model`` with ``--model``) on the same blocks, seed, tokens / inputs and
   thresholds -- the verdicts ``verify --reference`` gives without ``--tp``.

Both must pass. The reference file is opened before any rank starts, so a missing or broken one is
a usage error that costs no rank start-up.
"""

from __future__ import annotations

import os

from h3quant.sources import open_as_comfy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3quant.runtime.devices import Device


def precheck_reference(reference: str | os.PathLike, mmap: bool = True) -> None:
    """Open the reference's header (and shards) once: a missing or malformed file fails here,
    in the caller, with the same error the single-device verify gives."""
    open_as_comfy(reference, mmap=mmap).close()  # any layout convert takes


def reference_verdict(path, reference, *, device: str | Device, blocks, tokens: int, seed: int,
                      sigma: float, mmap: bool, backend: str | None, model: bool,
                      model_inputs=None, depth: int | None = None, thresholds=None):
    """The single-device verify of ``path`` against ``reference`` (a ``VerifyResult``, or a
    ``ModelResult`` with ``model``)."""
    if model:
        from h3quant.pipelines.verify.model import verify_model

        return verify_model(path, reference=reference, device=device, inputs=model_inputs,
                            depth=depth, mmap=mmap, backend=backend)
    from h3quant.pipelines.verify.blocks import verify_checkpoint

    return verify_checkpoint(path, reference=reference, device=device, blocks=blocks,
                             tokens=tokens, seed=seed, sigma=sigma, mmap=mmap,
                             thresholds=thresholds, backend=backend)
