"""``capture --tp N`` on accelerators, on a CPU-only machine: simulated CUDA GPUs and simulated
Ascend NPUs give the single-process capture's statistics (the tolerance of
``helpers.stats_compare``), torchrun-style ranks form one group where only rank 0 writes, and
every refusal (a device without collectives, too few devices, no NCCL, torchrun's WORLD_SIZE
against --tp) is a usage error before any rank starts: exit 2, no traceback, no output.

SIMULATED: ``h3quant.testing.sim_gpus`` makes torch report CUDA GPUs (h3quant's device check,
nccl choice and check, device count and per-rank ``set_device`` run as on a CUDA machine; the
ranks compute on the CPU over gloo); ``h3quant.testing.sim_npu`` runs each rank's tensors on a
simulated NPU (hccl's transport is gloo's on the CPU data), as verify's tensor-parallel tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from h3quant.pipelines.capture import capture_statistics
from h3quant.pipelines.capture_tp import TpHooks
from h3quant.runtime.probe import StaticProbe
from h3quant.testing.sim_gpus import simulated_cuda_machine

from helpers.cli import run
from helpers.inputs import synth_world
from helpers.stats_compare import assert_same_statistics

pytestmark = pytest.mark.slow  # tensor-parallel ranks (forked processes)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = synth_world(tmp_path_factory.mktemp("tpdev"), seed=5, calls=2)
    w["ins"], w["one"] = w["inputs"], w["d"] / "one.stats"
    capture_statistics(w["src"], w["ins"], w["one"], predict=False)  # one process on the CPU
    return w


@contextmanager
def _cuda_rank(ctx):
    """Inside each rank of the simulated CUDA machine: h3quant made ``cuda:<rank>`` current
    (what a real GPU rank gets); the rank then computes on the CPU (no GPU memory here)."""
    assert ctx.device == f"cuda:{ctx.local_rank}", ctx.device
    assert torch.cuda.current_device() == ctx.local_rank
    assert ctx.backend == "gloo"  # the simulated nccl transport
    yield StaticProbe(name="cpu ranks of a simulated CUDA machine"), "cpu"


def test_simulated_cuda_tp2_equals_the_single_process_capture(world):
    out = world["d"] / "cuda_tp2.stats"
    with simulated_cuda_machine(2):
        res = capture_statistics(world["src"], world["ins"], out, device="cuda", tp=2,
                                 predict=False, memory_budget=600_000,  # one call spilled
                                 tp_hooks=TpHooks(start_method="fork", dist_backend="gloo",
                                                  rank_setup=_cuda_rank))
    assert res is not None and res.rows > 0
    one = assert_same_statistics(world["one"], out)
    assert float(one["blocks.1.mlp.fc2.absmax"].abs().max()) > 0
    assert not any(p.name.endswith(".h3q-spill") for p in world["d"].iterdir())


@contextmanager
def _npu_rank(ctx):
    """Each rank's tensors on a simulated NPU; rank 0 must have accumulated H there."""
    from h3quant.testing.sim_npu import simulated_npu

    with simulated_npu() as sim:
        yield sim.probe, "npu:0"
        on_device = sim.device.ops(on_device=True)
        assert on_device  # the rank's forward ran on the device
        if ctx.rank == 0:  # H = X^T X accumulated on the device, not the host
            assert "aten::addmm_" in on_device, sorted(set(on_device))
            assert "aten::addmm_" not in sim.device.ops(on_device=False)


def test_simulated_npu_ranks_equal_the_single_process_capture(world):
    from h3quant.testing.sim_npu import SimNpuCollectives

    out = world["d"] / "npu_tp2.stats"
    capture_statistics(world["src"], world["ins"], out, tp=2, predict=False,
                       tp_hooks=TpHooks(start_method="fork", comm_cls=SimNpuCollectives,
                                        rank_setup=_npu_rank))
    assert_same_statistics(world["one"], out)


def test_torchrun_style_ranks_capture_once(world):
    """Two `python -m h3quant capture --tp 2` processes with torchrun's environment form one
    group (CPU ranks, gloo); rank 0 writes OUT, rank 1 writes and prints nothing."""
    from h3quant.runtime.tp.launch import free_port

    out = world["d"] / "torchrun.stats"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, TORCHELASTIC_RUN_ID="t", RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "h3quant", "capture", str(world["src"]), "--inputs",
             *map(str, world["ins"]), "--out", str(out), "--tp", "2", "--tp-timeout", "120",
             "--no-predict", "--json"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert '"rows_per_layer"' in outs[0][0]
    assert outs[1][0] == ""  # only rank 0 reports
    assert_same_statistics(world["one"], out)


# ------------------------------------------------------------------ refusals: before any rank


@pytest.fixture
def no_rank(monkeypatch):
    started: list[str] = []
    monkeypatch.setattr("h3quant.runtime.tp.launch.spawn_ranks",
                        lambda *a, **k: started.append("spawn"))
    monkeypatch.setattr("h3quant.runtime.tp.launch.join_torchrun",
                        lambda *a, **k: started.append("join"))
    return started


def _refused(world, no_rank, *args, says):
    out = world["d"] / "refused.stats"
    r = run("capture", world["src"], "--inputs", world["ins"][0], "--out", out, "--no-predict",
            *args)
    assert r.exit_code == 2, r.output
    assert says in r.output, r.output
    assert "Traceback" not in r.output
    assert not out.exists() and not Path(str(out) + ".h3q-spill").exists()
    assert not no_rank
    return r.output


def test_mps_has_no_collectives(world, no_rank, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)  # SIMULATED: a Mac
    _refused(world, no_rank, "--device", "mps", "--tp", "2",
             says="device 'mps' has no torch.distributed backend")


def test_more_ranks_than_gpus(world, no_rank):
    with simulated_cuda_machine(1):
        _refused(world, no_rank, "--device", "cuda", "--tp", "2",
                 says="tp=2 needs 2 CUDA devices, this machine has 1")


def test_torch_without_nccl(world, no_rank):
    with simulated_cuda_machine(2, nccl=False):
        _refused(world, no_rank, "--device", "cuda", "--tp", "2", says="has no NCCL")


def test_no_cuda_on_this_machine(world, no_rank):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # noted, not silent
    _refused(world, no_rank, "--device", "cuda", "--tp", "2",
             says="no cuda device is available on this machine")


def _torchrun_env(monkeypatch, rank: int, world: int) -> None:
    for k, v in dict(TORCHELASTIC_RUN_ID="t", RANK=str(rank), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)


def test_torchrun_world_size_must_equal_tp(world, no_rank, monkeypatch):
    _torchrun_env(monkeypatch, 0, 4)
    _refused(world, no_rank, "--tp", "2", says="--tp 2 but torchrun started WORLD_SIZE=4 ranks")


def test_torchrun_rank_without_its_gpu(world, no_rank, monkeypatch):
    _torchrun_env(monkeypatch, 1, 2)
    with simulated_cuda_machine(1):  # LOCAL_RANK=1 needs cuda:1
        _refused(world, no_rank, "--device", "cuda", "--tp", "2",
                 says="torchrun's LOCAL_RANK=1 needs 2 CUDA devices, this machine has 1")


def test_tp_timeout_needs_tp(world, no_rank):
    _refused(world, no_rank, "--tp-timeout", "5", says="--tp-timeout needs --tp")
