"""``plan_launch``: the checks every ``--tp N`` command (verify, capture) makes before it reads a
file, in order, and the launch they describe; how spawned ranks start (fork only with one
thread a rank: a forked OpenMP team would hang).

SIMULATED: ``h3quant.testing.sim_gpus`` makes torch report CUDA GPUs; MPS is reported present by
patching ``torch.backends.mps.is_available``."""

import sys

import pytest
import torch

from h3quant.errors import DeviceError, UsageError
from h3quant.runtime.tp.launch import Launch, plan_launch
from h3quant.runtime.tp.plan import TpError
from h3quant.testing.sim_gpus import simulated_cuda_machine


def _torchrun(monkeypatch, rank: int, world: int) -> None:
    for k, v in dict(TORCHELASTIC_RUN_ID="t", RANK=str(rank), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)


def test_spawned_cpu_ranks():
    assert plan_launch(4, "cpu") == Launch(4, "cpu", False, 0)


def test_torchrun_rank_is_read_and_checked(monkeypatch):
    _torchrun(monkeypatch, 1, 2)
    assert plan_launch(2, "cpu") == Launch(2, "cpu", True, 1)
    with pytest.raises(UsageError, match="--tp 4 but torchrun started WORLD_SIZE=2"):
        plan_launch(4, "cpu")


def test_simulated_gpus_are_counted():
    with simulated_cuda_machine(2):
        assert plan_launch(2, "cuda") == Launch(2, "cuda", False, 0)
        with pytest.raises(TpError, match="tp=4 needs 4 CUDA devices, this machine has 2"):
            plan_launch(4, "cuda")
    with simulated_cuda_machine(2, nccl=False), pytest.raises(TpError, match="has no NCCL"):
        plan_launch(2, "cuda")


def test_devices_without_collectives_or_absent(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no cuda device is available on this machine"):
            plan_launch(2, "cuda")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(TpError, match="device 'mps' has no torch.distributed backend"):
        plan_launch(2, "mps")
    with pytest.raises(TpError, match="--tp N is required"):
        plan_launch(None, "cpu")


def _copies(ctx):
    x = torch.randn(2048, 2048).to(torch.bfloat16)
    return float(x.float().sum())  # large enough for an OpenMP team where threads > 1


def test_a_forked_rank_does_not_hang_after_the_parents_openmp_team():
    """GNU libgomp is not fork-safe: a forked child that starts an OpenMP team after its parent
    ran one waits forever. A forked rank therefore runs one thread (tp=1 here would otherwise
    get every core)."""
    from h3quant.runtime.tp.launch import spawn_ranks

    torch.randn(2048, 2048).to(torch.bfloat16).float()  # the parent's team
    got = spawn_ranks(_copies, 1, start_method="fork", timeout_s=30, deadline_s=60)
    assert isinstance(got, float)


def test_fork_only_where_each_rank_runs_one_thread(monkeypatch):
    from h3quant.runtime.tp.launch import default_start_method, rank_threads

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_start_method("cuda", 2) == "spawn"
    assert default_start_method("cpu", 2) == "spawn"  # 8 threads a rank: not forked
    assert rank_threads(2, "spawn") == 8 and rank_threads(2, "fork") == 1
    if sys.platform.startswith("linux"):
        assert default_start_method("cpu", 16) == "fork"
