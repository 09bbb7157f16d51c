"""Shared by the reliability tests: run ``h3quant`` in a child under a memory cap and a timeout,
and the tiny synthetic files they feed it (made here, nothing downloaded)."""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "H3QUANT_DEBUG": ""}


def memory_cap(wanted: int = 4 << 30) -> int:
    """``wanted`` bytes of address space, never above this process's own hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    caps = [c for c in (hard, soft) if c != resource.RLIM_INFINITY]
    return min([wanted] + caps)


def _limit():
    cap = memory_cap()
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def h3q(*args, timeout: float = 120, stdin=None) -> subprocess.CompletedProcess:
    """``python -m h3quant ARGS`` under ``memory_cap()`` and ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT,
                          preexec_fn=_limit, stdin=stdin)


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tiny_base(path: Path, blocks: int = 2, seed: int = 11) -> Path:
    from h3quant.synth import synth_checkpoint

    synth_checkpoint(path, preset="tiny", blocks=blocks, seed=seed, workers=1)
    return path


def tiny_lora(path: Path, style: str = "comfyui", blocks: int = 1, rank: int = 2) -> Path:
    from h3quant.formats.rules.topology import config_for
    from h3quant.synth_lora import write_lora

    write_lora(path, config_for("tiny", blocks=blocks), style, rank=rank, scale=0.01, seed=1,
               overwrite=True)
    return path
