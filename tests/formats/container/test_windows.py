"""Windows: POSIX-only calls live in one module (``formats/container/platform.py``) with portable
fallbacks, and the commands run to completion in a simulated Windows interpreter
(``h3quant.testing.sim_windows``: POSIX modules absent, ``sys.platform == "win32"``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import h3quant
from h3quant.formats.container import platform
from h3quant.testing.sim_windows import _fake_msvcrt

PKG = Path(h3quant.__file__).parent
POSIX_ONLY_MODULES = {"fcntl", "resource", "termios", "msvcrt", "grp", "pwd"}
POSIX_ONLY_OS = {"pwrite", "pread", "fdatasync", "fchmod", "open", "O_NONBLOCK", "O_CLOEXEC",
                 "set_blocking", "sched_getaffinity"}
POSIX_ONLY_SIGNALS = {"SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGKILL"}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in POSIX_ONLY_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in POSIX_ONLY_MODULES:
                found.append(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in POSIX_ONLY_OS:
                found.append(f"os.{node.attr}")
            if node.value.id == "signal" and node.attr in POSIX_ONLY_SIGNALS:
                found.append(f"signal.{node.attr}")
    return [f"{path.relative_to(PKG)}:{name}" for name in found]


def test_posix_only_calls_live_in_the_platform_module():
    offences = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "platform.py" and path.parent.name == "container":
            continue
        if "testing" in path.relative_to(PKG).parts:
            continue  # the simulations themselves
        offences += _offences(path)
    assert not offences, offences


def test_pwrite_fallback_is_positioned_and_thread_safe(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "pwrite")
    fd = platform.open_fd(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 64 * 4096)

        def fill(i):
            for j in range(0, 4096, 512):
                assert platform.pwrite(fd, bytes([i]) * 512, i * 4096 + j) == 512

        threads = [threading.Thread(target=fill, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(bytes([i]) * 4096 for i in range(64))


def test_locking_falls_back_to_msvcrt(tmp_path, monkeypatch):
    import fcntl

    fake = _fake_msvcrt(fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN)
    monkeypatch.setattr(platform, "fcntl", None)
    monkeypatch.setattr(platform, "msvcrt", fake)
    a = platform.open_fd(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    b = platform.open_fd(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert platform.try_lock(a)
        assert not platform.try_lock(b)  # held by another handle
    finally:
        os.close(a)
    try:
        assert platform.try_lock(b)  # released with its handle
    finally:
        os.close(b)


def test_windows_rename_never_replaces(tmp_path, monkeypatch):
    monkeypatch.setattr(platform, "IS_WINDOWS", True)
    calls = []
    real = os.rename

    def windows_rename(src, dst):  # Windows' rename refuses an existing target
        calls.append(dst)
        if os.path.lexists(dst):
            raise FileExistsError(17, "exists", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "rename", windows_rename)
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        platform.rename_noreplace(tmp_path / "a", tmp_path / "b")
    platform.rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c").read_text() == "a" and (tmp_path / "b").read_text() == "b"
    assert calls == [tmp_path / "b", tmp_path / "c"]


def test_signals_are_those_the_platform_has():
    import signal

    assert signal.SIGTERM in platform.TERMINATION_SIGNALS
    assert signal.SIGINT in platform.DEFERRED_SIGNALS
    assert all(isinstance(s, int) for s in platform.DEFERRED_SIGNALS)


def _sim(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant.testing.sim_windows", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_commands_complete_in_a_simulated_windows_interpreter(tmp_path):
    from h3quant.synth import synth_checkpoint

    src = tmp_path / "h3.safetensors"
    synth_checkpoint(src, preset="tiny", seed=0)
    probe = subprocess.run(
        [sys.executable, "-c", "from h3quant.testing.sim_windows import simulate_windows as s; "
         "s(); import os, signal, sys; from h3quant.formats.container import platform as p; "
         "print(sys.platform, hasattr(os, 'pwrite'), hasattr(signal, 'SIGHUP'), p.fcntl, "
         "p.resource, p.msvcrt is not None)"],
        capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["win32", "False", "False", "None", "None", "True"], probe
    for args in (("inspect", src), ("validate", src),
                 ("convert", src, "out.safetensors", "--to", "int8-convrot"),
                 ("validate", "out.safetensors"),
                 ("convert", src, "out.safetensors", "--to", "int8-convrot", "--overwrite"),
                 ("verify", "out.safetensors", "--reference", src)):
        res = _sim(*args, cwd=tmp_path)
        assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-3000:])
    res = _sim("convert", src, "out.safetensors", cwd=tmp_path)  # no-clobber holds
    assert res.returncode == 2 and "exists" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3.safetensors", "out.safetensors"]
