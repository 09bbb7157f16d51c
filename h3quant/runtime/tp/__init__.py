"""Tensor parallel on torch.distributed with a shared activation scale (FORMATS.md 7).

``plan`` (which rows / K columns each rank holds), ``shard_load`` (per-rank byte-range reads),
``linears`` (row-parallel shared / per-rank scale), ``group`` (process group, collectives with
timeouts), ``launch`` (spawn or torchrun), ``runner`` (a block sharded for one rank).
"""

from h3quant.runtime.tp.plan import MAX_INT32_K, SCALE_MODES, TpError

__all__ = ["MAX_INT32_K", "SCALE_MODES", "TpError"]
