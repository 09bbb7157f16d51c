"""How a tensor-parallel run was launched, read from the environment -- and only trusted when the
command line asked for tensor parallel.

``--tp N`` decides: without it ``verify`` never becomes a rank, whatever ``RANK`` / ``WORLD_SIZE``
/ ``MASTER_PORT`` a shell or a job scheduler left behind. With it, the process joins torchrun's
group when torchrun's variables are all present *and* ``TORCHELASTIC_RUN_ID`` (which torchrun sets
for every rank it starts and a stray export rarely does) is set; otherwise it spawns its N local
ranks itself. The coordinates of a recognised launch are checked here: a non-integer, negative
or out-of-range ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_PORT`` is a usage error
naming the variable, before any group is joined.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from h3quant.errors import UsageError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"


@dataclass(frozen=True)
class TorchrunCoords:
    rank: int
    world: int
    local_rank: int
    addr: str
    port: int


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when this process is a rank torchrun started (its variables and its run id)."""
    env = os.environ if env is None else env
    return TORCHRUN_MARKER in env and all(v in env for v in TORCHRUN_VARS)


def _int(env: Mapping[str, str], name: str, lo: int, hi: int | None = None) -> int:
    raw = env[name].strip()
    try:
        value = int(raw, 10)
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not an integer "
                         "(torchrun sets it; unset it or launch with torchrun)") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo} .. {hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"environment variable {name}={value} is out of range ({bound})")
    return value


def torchrun_coords(env: Mapping[str, str] | None = None,
                    tp: int | None = None) -> TorchrunCoords:
    """The checked coordinates of a torchrun launch; ``UsageError`` naming the bad variable."""
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    if rank >= world:
        raise UsageError(f"environment variable RANK={rank} must be below WORLD_SIZE={world}")
    local = _int(env, "LOCAL_RANK", 0)
    if local > rank:
        raise UsageError(f"environment variable LOCAL_RANK={local} exceeds RANK={rank}")
    port = _int(env, "MASTER_PORT", 1, 65535)
    addr = env["MASTER_ADDR"].strip()
    if not addr:
        raise UsageError("environment variable MASTER_ADDR is empty")
    if tp is not None and tp != world:
        raise UsageError(f"--tp {tp} but torchrun started WORLD_SIZE={world} ranks; they must "
                         "agree")
    return TorchrunCoords(rank, world, local, addr, port)
