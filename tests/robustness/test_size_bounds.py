"""Bounded sizes: every size a header or an option names is checked against a documented limit
(h3quant.limits) or processed in bounded memory. The subprocess cases run under an address-space
limit, so a regression fails with an error instead of exhausting the shared machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.h3files import small_h3, write

from h3quant import limits
from h3quant.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
AS_LIMIT = 6 << 30  # bytes of address space for a child (torch alone maps about 1.5 GB)


def memory_cap(cap: int = AS_LIMIT) -> int:
    """``cap``, never above this process's own hard limit (a child may not be given more than
    the suite itself has: under ``ulimit -v`` the cap shrinks to it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    return cap if hard == resource.RLIM_INFINITY else min(cap, hard)


def _limit_memory():
    cap = memory_cap()
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def test_memory_cap_never_exceeds_the_own_hard_limit(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda what: (5_000_000_000, 5_000_000_000))
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: calls.append(lim))
    _limit_memory()
    assert calls == [(5_000_000_000, 5_000_000_000)]
    monkeypatch.setattr(resource, "getrlimit",
                        lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    _limit_memory()
    assert calls[-1] == (AS_LIMIT, AS_LIMIT)


def h3q(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT, preexec_fn=_limit_memory)


# ------------------------------------------------------------- block indices in a header
@pytest.mark.slow
@pytest.mark.parametrize("index", ["999999999", "1000", "7" * 5000], ids=["1e9", "1000", "5000-digits"])
def test_absurd_block_index_is_a_finding_everywhere(tmp_path, index):
    t = small_h3(blocks=1)
    t[f"blocks.{index}.norm1.weight"] = torch.ones(4)
    src = write(tmp_path / "in.safetensors", t)
    res = h3q("inspect", src)
    assert res.returncode == 0, res.stderr  # inspect describes, validate judges
    res = h3q("validate", src)
    assert res.returncode == 1 and "T106" in res.stdout + res.stderr, res.stdout + res.stderr
    res = h3q("convert", src, tmp_path / "o.safetensors")
    assert res.returncode == 1 and "T106" in res.stderr, res.stderr
    assert not (tmp_path / "o.safetensors").exists()
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_absurd_block_index_in_a_file_that_is_not_h3_is_one_verdict(tmp_path):
    """No H3 detected (only the absurd block): validate still reports T106, as convert refuses."""
    src = write(tmp_path / "in.safetensors",
                {"blocks.1000000000000.attn.qkv_proj.weight": torch.ones(4, 4)})
    res = h3q("validate", src)
    assert res.returncode == 1 and "T106" in res.stdout, res.stdout + res.stderr
    res = h3q("convert", src, tmp_path / "o.safetensors")
    assert res.returncode == 1 and "T106" in res.stderr, res.stderr


def test_block_index_just_below_the_limit_is_legal(tmp_path):
    from h3quant.h3.topology import block_index_beyond_limit

    assert block_index_beyond_limit(f"blocks.{limits.MAX_BLOCKS - 1}.norm1.weight") is None
    assert block_index_beyond_limit(f"blocks.{limits.MAX_BLOCKS}.norm1.weight") == 1000
    assert block_index_beyond_limit("token_refiner.blocks.00001.x") is None


# ------------------------------------------------------------- verify --model sizes
def test_model_inputs_beyond_the_row_limit_are_refused_before_work():
    from h3quant.pipelines.verify.model import ModelInputs

    with pytest.raises(UsageError, match="16,384"):
        ModelInputs(frames=1024, height=4096, width=4096)
    with pytest.raises(UsageError):
        ModelInputs(frames=1, height=2, width=2, audio_frames=8192, text_tokens=64)
    # the limit itself is legal: text + 2 x audio + video = 16384 exactly
    ModelInputs(frames=4, height=62, width=62, audio_frames=4, text_tokens=16384 - 8 - 3844)


@pytest.mark.parametrize("args", [
    ["--frames", "1024", "--height", "4096", "--width", "4096"],
    ["--frames", "64", "--height", "64", "--width", "64"],
    ["--audio-frames", "65536"],
])
@pytest.mark.slow
def test_verify_model_large_inputs_exit_2_at_once(tmp_path, args):
    src = write(tmp_path / "in.safetensors", small_h3(blocks=1))
    res = h3q("verify", src, "--model", "--device", "cpu", *args, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "limit" in res.stderr or "range" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_help_states_the_limits():
    res = h3q("verify", "--help")
    assert "16,384" in res.stdout and str(limits.MAX_AUDIO_FRAMES) in res.stdout
    res = h3q("convert", "--workers", str(limits.MAX_WORKERS + 1), "a", "b")
    assert res.returncode == 2 and str(limits.MAX_WORKERS) in res.stderr


# ------------------------------------------------------------- attention in bounded blocks
@pytest.mark.slow
def test_attention_scores_stay_within_the_budget(monkeypatch):
    """Per-block verify at --tokens 16384 made one head's 16384 x 16384 scores (1 GiB, three
    copies). Scores are now taken in query-row blocks: never more than the budget at once, and
    the result is plain softmax attention (computed here independently)."""
    from h3quant.runtime.model import ops

    budget = 1 << 12
    monkeypatch.setattr(ops, "SCORE_BUDGET_ELEMS", budget)
    seen = []
    real = torch.softmax

    def spy(x, *a, **k):
        seen.append(x.numel())
        return real(x, *a, **k)

    monkeypatch.setattr(torch, "softmax", spy)
    g = torch.Generator().manual_seed(0)
    s, h, d = 200, 3, 8
    q, k, v = (torch.randn(s, h, d, generator=g) for _ in range(3))
    got = ops.attention(q, k, v)
    assert seen and max(seen) <= budget
    ref = torch.stack([real((q[:, i] @ k[:, i].T) / d ** 0.5, dim=-1) @ v[:, i]
                       for i in range(h)], dim=1).reshape(s, h * d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- W4A8 at many workers
@pytest.mark.slow
def test_w4a8_in_flight_chunks_do_not_grow_with_workers(monkeypatch):
    """--workers 256 made W4A8 submit every row chunk at once (5.2 GB instead of 0.8 GB on a
    full-size layer): at most MAX_INFLIGHT_CHUNKS are now queued or running."""
    from concurrent.futures import ThreadPoolExecutor

    from h3quant.formats.w4a8 import tensors as w4

    class Counting(ThreadPoolExecutor):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.live = self.peak = 0

        def submit(self, fn, *a, **k):
            self.live += 1
            self.peak = max(self.peak, self.live)
            fut = super().submit(fn, *a, **k)

            def done(_):
                self.live -= 1
            fut.add_done_callback(done)
            return fut

    monkeypatch.setattr(w4, "_ROW_ELEM_BUDGET", 16 * 256)  # 16-row chunks: 128 of them
    w = torch.randn(2048, 256, generator=torch.Generator().manual_seed(1))
    ref = w4.encode_w4a8(w, codebook="frozen")
    with Counting(64) as pool:
        out = w4.encode_w4a8(w, codebook="frozen", pool=pool)
    assert 1 < pool.peak <= w4.MAX_INFLIGHT_CHUNKS
    assert all(torch.equal(ref[s].view(torch.uint8) if ref[s].dtype == torch.float8_e4m3fn
                           else ref[s], out[s].view(torch.uint8)
                           if out[s].dtype == torch.float8_e4m3fn else out[s]) for s in ref)
