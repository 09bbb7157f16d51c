"""Tensor parallel never hangs and is chosen by the command line only.

Faults are injected from outside: a plain TCP server in the test on the MASTER_PORT a rank is
given (silent, garbage, closing at once), a rank that never joins, a rank killed in the middle
of a collective (a wrapper process that patches the collectives, then runs the CLI). Every case
must end with exit 2 and a clear message well within a generous bound (the machine is shared).
"""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow  # processes / tensor-parallel ranks: the slow subset

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 5  # --tp-timeout of every case
BOUND = 30  # seconds a case may take in all (start-up of torch included)
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


def _torchrun_env(rank: int, world: int, port: int, **extra) -> dict:
    return _clean_env(TORCHELASTIC_RUN_ID="test-run", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **extra)


def _verify_argv(path, *extra) -> list[str]:
    return [sys.executable, "-m", "h3quant", "verify", str(path), "--tp", "2", "--blocks", "1",
            "--tokens", "8", "--tp-timeout", str(TIMEOUT), *extra]


class Hostile:
    """A TCP server on a free loopback port that does ``how`` to every connection."""

    def __init__(self, how: str):
        self.how, self.held = how, []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.how == "garbage":
                try:
                    conn.sendall(b"\xff\x00" * 2048 + b"HTTP/1.1 400 Bad Request\r\n\r\n")
                except OSError:
                    pass
            if self.how == "close":
                conn.close()
            else:
                self.held.append(conn)  # silent / garbage: keep it open, say nothing more

    def close(self):
        self.sock.close()
        for c in self.held:
            c.close()


def _timed(argv, env, timeout=BOUND + 60):
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: no exit within {timeout} s")
    return p, time.monotonic() - t0


@pytest.mark.parametrize("how", ["silent", "garbage", "close"])
@pytest.mark.parametrize("rank", [0, 1])
def test_whatever_listens_on_master_port_the_rank_ends_in_time(files, how, rank):
    srv = Hostile(how)
    try:
        p, took = _timed(_verify_argv(files["int8"]), _torchrun_env(rank, 2, srv.port))
    finally:
        srv.close()
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert f"rank {rank}: cannot join the gloo group of 2" in p.stderr, p.stderr[-2000:]
    assert f"MASTER_PORT={srv.port}" in p.stderr
    assert "Traceback" not in p.stderr
    assert took < BOUND, took


def test_a_rank_that_never_joins(files):
    from h3quant.runtime.tp.launch import free_port

    p, took = _timed(_verify_argv(files["int8"]), _torchrun_env(0, 2, free_port()))
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "rank 0: cannot join the gloo group of 2" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert took < BOUND, took


# rank 1 runs the CLI with its collectives patched: it dies (or stops answering) on its first
_FAULTY_RANK = """
import os, sys, time
from h3quant.runtime.tp import group
how = os.environ["FAULT"]
def _run(self, what, start):
    if how == "die":
        os._exit(9)
    time.sleep(3600)
group.Collectives._run = _run
from h3quant.cli import main
sys.argv = ["h3quant"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_rank_lost_in_the_middle_of_a_collective(files, fault):
    from h3quant.runtime.tp.launch import free_port

    port = free_port()
    argv = _verify_argv(files["int8"])
    t0 = time.monotonic()
    good = subprocess.Popen(argv, cwd=ROOT, env=_torchrun_env(0, 2, port),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bad = subprocess.Popen([sys.executable, "-c", _FAULTY_RANK, *argv[3:]], cwd=ROOT,
                           env=_torchrun_env(1, 2, port, FAULT=fault),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = good.communicate(timeout=BOUND + 60)
    except subprocess.TimeoutExpired:
        good.kill()
        pytest.fail("rank 0 hung")
    finally:
        bad.kill()
        bad.communicate()
    took = time.monotonic() - t0
    assert good.returncode == 2, (good.returncode, err[-2000:])
    assert "rank 0: all_gather of attn.qkv_proj outputs failed after at most" in err, err[-2000:]
    assert "Traceback" not in err
    assert took < BOUND, took


# ------------------------------------------------------------------ the mode: the command line


@pytest.mark.parametrize("marker", [False, True])
def test_stray_torchrun_variables_do_not_make_plain_verify_a_rank(files, marker):
    srv = Hostile("silent")  # were it a rank, it would try this port
    env = _torchrun_env(1, 2, srv.port)
    if not marker:
        del env["TORCHELASTIC_RUN_ID"]
    try:
        p, took = _timed([sys.executable, "-m", "h3quant", "verify", str(files["int8"]),
                          "--blocks", "1", "--tokens", "8", "--json"], env)
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"scale_mode"' not in p.stdout and '"layers"' in p.stdout  # the per-block verdict
    assert took < BOUND + 30


def test_tp_with_stray_variables_but_no_torchrun_spawns_its_own_ranks(files, monkeypatch):
    from h3quant.cli import main

    srv = Hostile("silent")
    try:
        for k, v in _torchrun_env(1, 4, srv.port).items():
            if k in TORCHRUN_VARS and k != "TORCHELASTIC_RUN_ID":
                monkeypatch.setenv(k, v)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        r = CliRunner().invoke(main, ["verify", str(files["int8"]), "--tp", "2", "--blocks",
                                      "1", "--tokens", "8", "--tp-timeout", "60", "--json"])
    finally:
        srv.close()
    assert r.exit_code == 0, r.output
    assert '"launched": "spawn"' in r.output and '"tp": 2' in r.output


@pytest.mark.parametrize("var,value,says", [
    ("RANK", "abc", "RANK='abc' is not an integer"),
    ("RANK", "-1", "RANK=-1 is out of range"),
    ("RANK", "2", "RANK=2 must be below WORLD_SIZE=2"),
    ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer"),
    ("WORLD_SIZE", "0", "WORLD_SIZE=0 is out of range"),
    ("LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer"),
    ("MASTER_PORT", "99999", "MASTER_PORT=99999 is out of range"),
])
def test_malformed_torchrun_variables_are_usage_errors(files, monkeypatch, var, value, says):
    from h3quant.cli import main

    for k, v in _torchrun_env(0, 2, 29500).items():
        if k in TORCHRUN_VARS:
            monkeypatch.setenv(k, v)
    monkeypatch.setenv(var, value)
    spawned = []
    monkeypatch.setattr("h3quant.runtime.tp.launch.init_group",
                        lambda *a, **k: spawned.append(a))
    r = CliRunner().invoke(main, ["verify", str(files["int8"]), "--tp", "2"])
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output
    assert not spawned
