"""Fault injection: signals, killed runs, racing runs, non-regular and changing inputs, hostile
indexes and JSON, zero-sized layers. Each case ends in a clear error or a finding, exit 1 or 2,
never a traceback, a hang, a bus error or a partial output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.h3files import sha, small_h3, write

from h3quant.errors import ContainerError
from h3quant.formats.container import atomic
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.pipelines.convert import ConvertOptions, convert

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def h3q(*args, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3quant", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT, **kw)


def cli(*args):
    from click.testing import CliRunner

    from h3quant.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def no_traceback(res) -> None:
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode in (0, 1, 2), (res.returncode, res.stderr)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ----------------------------------------------------------------------------- signals
SLOW_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import h3quant.formats.int8.tensors as int8
    real = int8.encode_int8
    src, dst, flag, report = sys.argv[1:5]
    def slow(*a, **k):
        Path(flag).write_text("busy")
        time.sleep(60)
        return real(*a, **k)
    int8.encode_int8 = slow
    from h3quant.cli import main
    sys.argv = ["h3quant", "convert", src, dst, "--quiet", "--workers", "1", "--report", report]
    main()
""")


def _start_slow(src: Path, tmp_path: Path):
    dst, flag, rep = tmp_path / "out.safetensors", tmp_path / "flag", tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, str(src), str(dst), str(flag),
                             str(rep)], stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        assert time.monotonic() < deadline
        time.sleep(0.05)
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(atomic.STAGING_PREFIX)]
    assert staged, "the run stages its outputs beside them"
    return proc, dst, rep


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_run_cleans_up_like_ctrl_c(src, tmp_path, sig):
    """SIGTERM (timeout, systemd, Docker, SLURM) and SIGHUP remove every temporary as SIGINT
    does, within seconds (the encoder call in flight sleeps 60 s)."""
    before = sha(src)
    proc, dst, rep = _start_slow(src, tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    expect = 130 if sig == signal.SIGINT else 128 + sig
    assert proc.returncode == expect, err
    assert "Traceback" not in err and "nothing written" in err
    assert names(tmp_path) == ["flag", "in.safetensors"]
    assert sha(src) == before


@pytest.mark.slow
def test_killed_run_leaves_staging_that_the_next_run_removes(src, tmp_path):
    """SIGKILL cannot be caught: the staging directory stays, its lock dies with the process,
    and the next run writing there removes it and says so."""
    proc, dst, rep = _start_slow(src, tmp_path)
    proc.kill()
    proc.wait()
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(atomic.STAGING_PREFIX)]
    assert len(stale) == 1
    res = h3q("convert", src, dst, "--report", rep)
    assert res.returncode == 0, res.stderr
    assert "removed stale temporary" in res.stderr and stale[0].name in res.stderr
    assert names(tmp_path) == ["flag", "in.safetensors", "out.safetensors", "r.json"]


@pytest.mark.slow
def test_two_racing_converts_one_wins_the_other_fails_cleanly(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    procs = [subprocess.Popen([sys.executable, "-m", "h3quant", "convert", str(src), str(dst),
                               "--quiet", "--no-report", "--workers", "1"],
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for _ in range(2)]
    outs = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    # overlapping or not, the second to finish must refuse (no --overwrite), never replace
    assert sorted(c for c, _ in outs) == [0, 2], outs
    loser = next(e for c, e in outs if c == 2)
    assert str(dst) in loser and "Traceback" not in loser
    assert names(tmp_path) == ["in.safetensors", "out.safetensors"]
    with Checkpoint(dst) as ck:  # the winner's file is complete
        assert len(ck.tensors) > 0


# ------------------------------------------------------------------- non-regular inputs
@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["inspect"], ["validate"], ["convert", "OUT"], ["verify"]])
def test_fifo_input_is_refused_before_any_read(tmp_path, cmd):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    args = [a if a != "OUT" else tmp_path / "o.safetensors" for a in cmd[1:]]
    res = h3q(cmd[0], fifo, *args, timeout=60)  # a blocking open would hang until the timeout
    assert res.returncode == 2, res.stderr + res.stdout
    assert "FIFO" in res.stderr + res.stdout and str(fifo) in res.stderr + res.stdout
    assert names(tmp_path) == ["pipe.safetensors"]


@pytest.mark.slow
def test_device_input_and_fifo_index_are_refused(tmp_path):
    res = h3q("inspect", "/dev/zero", timeout=60)
    assert res.returncode == 2 and "device" in res.stderr
    os.mkfifo(tmp_path / "m.safetensors.index.json")
    res = h3q("inspect", tmp_path / "m.safetensors.index.json", timeout=60)
    assert res.returncode == 2 and "FIFO" in res.stderr


# ------------------------------------------------------------------ changing input
def test_input_truncated_while_converting_is_a_clear_error(src, tmp_path, monkeypatch):
    """A file shrinking under a memory mapping would end in SIGBUS; every mapped read checks
    the size first, so the run ends with an error and no output."""
    from h3quant.pipelines.convert import stream

    real = stream.run_plan

    def shrink_then_run(plan, ckpt, out, **kw):
        with open(src, "r+b") as fh:
            fh.truncate(os.path.getsize(src) // 2)
        return real(plan, ckpt, out, **kw)

    monkeypatch.setattr("h3quant.pipelines.convert.run_plan", shrink_then_run)
    # the mapped reads check the size; the kernel-side copy sees the early end of the source
    with pytest.raises(ContainerError, match="changed size while being read|source ended"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(report=False, workers=1))
    assert names(tmp_path) == ["in.safetensors"]


def test_input_rewritten_while_converting_gives_no_output(src, tmp_path, monkeypatch):
    from h3quant.pipelines.convert import stream

    real = stream.run_plan

    def touch_then_run(plan, ckpt, out, **kw):
        report = real(plan, ckpt, out, **kw)
        st = os.stat(src)
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return report

    monkeypatch.setattr("h3quant.pipelines.convert.run_plan", touch_then_run)
    with pytest.raises(ContainerError, match="modified while being read"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(report=False))
    assert names(tmp_path) == ["in.safetensors"]


def test_truncated_input_in_a_subprocess_ends_without_bus_error(tmp_path):
    """The real thing: a child maps the file, the file is cut, the child reads: no SIGBUS."""
    f = write(tmp_path / "in.safetensors", {"w": torch.ones(4096, 256)})
    child = textwrap.dedent(f"""
        import os
        from h3quant.formats.container.reader import SafetensorsFile
        sf = SafetensorsFile({str(f)!r})
        info = sf.tensors["w"]
        os.truncate({str(f)!r}, 4096)
        try:
            bytes(sf.read_bytes(info)[-16:])
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         env=ENV, timeout=60)
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert "ContainerError" in res.stdout and "changed size" in res.stdout


# ---------------------------------------------------------------------- shard index
def _sharded(tmp_path: Path) -> Path:
    from helpers.h3files import make_sharded

    return make_sharded(tmp_path / "ck", small_h3(blocks=1))


def _index(d: Path) -> Path:
    return next(d.glob("*.index.json"))


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "sub/../../x",
                                    "link.safetensors"])
def test_index_escaping_its_directory_is_refused(tmp_path, escape):
    d = _sharded(tmp_path)
    outside = write(tmp_path / "outside.safetensors", {"secret": torch.ones(2)})
    (d / "link.safetensors").symlink_to(outside)
    idx = _index(d)
    body = json.loads(idx.read_text())
    first = next(iter(body["weight_map"]))
    body["weight_map"][first] = escape
    idx.write_text(json.dumps(body))
    ck = Checkpoint(idx, strict=False)
    try:
        s106 = [f for f in ck.findings if f.code == "S106"]
        assert s106 and escape in s106[0].message
        assert all(sf.path.parent == d for sf in ck.files)
        assert "secret" not in ck.tensors
    finally:
        ck.close()
    res = cli("validate", idx, "--json")
    assert res.exit_code == 1
    assert "S106" in {f["code"] for f in json.loads(res.stdout)["findings"]}
    res = cli("convert", idx, tmp_path / "out")
    assert res.exit_code == 2 and "S106" in res.stderr
    assert not (tmp_path / "out").exists()


def test_tensor_in_another_shard_than_the_index_says_and_unindexed_shards(tmp_path):
    d = _sharded(tmp_path)
    idx = _index(d)
    body = json.loads(idx.read_text())
    shards = sorted(set(body["weight_map"].values()))
    name = next(n for n, s in body["weight_map"].items() if s == shards[0])
    body["weight_map"][name] = shards[1]
    idx.write_text(json.dumps(body))
    write(d / "extra.safetensors", {"x": torch.ones(2)})
    with Checkpoint(idx, strict=False) as ck:
        got = {f.code: f for f in ck.findings}
    assert "S107" in got and got["S107"].tensor == name
    assert "S108" in got and "extra.safetensors" in got["S108"].file


# ------------------------------------------------------------------------ hostile JSON
HOSTILE = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "huge-int": '{"a": {"dtype": "F32", "shape": [' + "9" * 10_000 + '], "data_offsets": [0, 4]}}',
    "huge-float": '{"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
    "bad-surrogate": '{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    "overflow-shape": json.dumps({"a": {"dtype": "F32", "shape": [2**62, 2**62],
                                        "data_offsets": [0, 4]}}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert"])
def test_hostile_header_json_is_a_finding_or_clear_error(tmp_path, case, cmd):
    from helpers.forge import raw_file

    text = HOSTILE[case].encode("utf-8", "surrogatepass")
    f = raw_file(tmp_path / "h.safetensors", text + b" " * (-len(text) % 8), b"\0" * 4)
    extra = [tmp_path / "o.safetensors"] if cmd == "convert" else []
    res = cli(cmd, f, *extra)
    assert res.exit_code in (1, 2) and "internal error" not in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("case", ["deep", "huge-int", "not-utf8", "huge"])
def test_hostile_index_json_is_a_finding(tmp_path, case):
    d = _sharded(tmp_path)
    idx = _index(d)
    raw = {"deep": b"[" * 100_000, "huge-int": b'{"weight_map": {"a": 1' + b"1" * 9000 + b"}}",
           "not-utf8": b'{"weight_map": {"\xff": "x"}}',
           "huge": b" " * ((64 << 20) + 1)}[case]
    idx.write_bytes(raw)
    res = cli("validate", idx, "--json")
    assert res.exit_code == 1, res.output
    assert "S101" in {f["code"] for f in json.loads(res.stdout)["findings"]}


def test_hostile_marker_json_is_a_finding(tmp_path):
    from helpers.forge import int8_layer, save

    t = int8_layer("blocks.0.mlp.fc1")
    deep = ("[" * 50_000).encode()
    t["blocks.0.mlp.fc1.comfy_quant"] = torch.frombuffer(bytearray(deep), dtype=torch.uint8)
    f = save(tmp_path / "m.safetensors", t, header=False)
    for cmd in ("inspect", "validate", "convert"):
        extra = [tmp_path / "o.safetensors"] if cmd == "convert" else []
        res = cli(cmd, f, *extra)
        assert res.exit_code in (0, 1, 2) and "internal error" not in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()


# --------------------------------------------------------------------- zero-sized layers
def test_zero_sized_layers_are_copied_not_encoded(tmp_path):
    f = write(tmp_path / "z.safetensors", {
        "a.weight": torch.zeros(0, 256, dtype=torch.bfloat16),
        "b.weight": torch.zeros(16, 0, dtype=torch.bfloat16),
        "c.weight": torch.randn(16, 256).bfloat16()})
    for target in ("int8-convrot", "int8", "w4a8"):
        out = tmp_path / f"o-{target}.safetensors"
        res = cli("convert", f, out, "--to", target)
        assert res.exit_code == 0, res.output
        assert "weight has no elements" in res.stderr
        assert cli("validate", out, "--deep").exit_code == 0


# ------------------------------------------------------------------------- threads
def test_signal_handlers_are_only_installed_in_the_main_thread():
    seen = []

    def worker():
        with atomic.terminate_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen and seen[0] is signal.getsignal(signal.SIGTERM)
