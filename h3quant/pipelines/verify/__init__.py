"""``verify``: run a checkpoint's layers on a device's int8 path against a float reference, per block
(``blocks``), as the whole streamed model (``model``) or tensor-parallel (``tp``); the three share
their result base and limits (``result``). Checks and limits: docs/verify.md.

The entry points are importable from here (loaded on first use: importing the package does not
import torch)::

    from h3quant.pipelines.verify import verify_checkpoint, verify_model, verify_tp
"""

_EXPORTS = {
    "Thresholds": "blocks", "VerifyResult": "blocks", "verify_checkpoint": "blocks",
    "ModelInputs": "model", "ModelThresholds": "model", "ModelVerifyResult": "model",
    "verify_model": "model",
    "TpResult": "tp", "verify_tp": "tp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"h3quant.pipelines.verify.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'h3quant.pipelines.verify' has no attribute {name!r}")
