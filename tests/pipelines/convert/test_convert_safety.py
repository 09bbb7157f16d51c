"""``convert`` refusals, atomicity (failure injection, SIGINT), dry run and the CLI surface."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.errors import ContainerError, ConvertError, FormatError, OutputError
from h3quant.pipelines.convert import ConvertOptions, LayerFailures, convert, plan_convert
from helpers.h3files import sha, small_h3, write


@pytest.fixture
def src(tmp_path) -> Path:
    return write(tmp_path / "in.safetensors", small_h3())


def leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ----------------------------------------------------------------------------- refusals
def test_refuses_output_equal_to_input(src, tmp_path):
    before = sha(src)
    for dst in (src, tmp_path / "." / "in.safetensors"):
        with pytest.raises(OutputError, match="output is the input"):
            convert(src, dst, ConvertOptions(overwrite=True))
    link = tmp_path / "link.safetensors"
    os.link(src, link)  # a hard link is the same file under another name
    with pytest.raises(OutputError, match="output is the input"):
        convert(src, link, ConvertOptions(overwrite=True))
    assert sha(src) == before
    res = run_cli("convert", src, src, "--overwrite")
    assert res.exit_code == 2 and "output is the input" in res.output


def test_refuses_existing_output_without_overwrite(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"keep me")
    res = run_cli("convert", src, dst)
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert dst.read_bytes() == b"keep me"
    res = run_cli("convert", src, dst, "--overwrite", "--quiet")
    assert res.exit_code == 0, res.output
    assert dst.read_bytes() != b"keep me"


@pytest.mark.parametrize("args, needle", [
    (["--group-size", "100"], "power of 4"),
    (["--group-size", "8"], "power of 4"),
    (["--include", "blocks.(["], "not a valid regular expression"),
    (["--exclude", "*x"], "not a valid regular expression"),
    (["--to", "fp6"], "fp6"),
    (["--workers", "0"], "workers"),
])
def test_usage_errors_exit_2_and_write_nothing(src, tmp_path, args, needle):
    dst = tmp_path / "out.safetensors"
    res = run_cli("convert", src, dst, *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not dst.exists()


def test_options_validate_in_the_api():
    with pytest.raises(ConvertError, match="power of 4"):
        ConvertOptions(group_size=128)
    with pytest.raises(ConvertError, match="regular expression"):
        ConvertOptions(include=("(",))


def test_unreadable_input_exits_2(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00")
    res = run_cli("convert", bad, tmp_path / "o.safetensors")
    assert res.exit_code == 2 and "error" in res.output
    res = run_cli("convert", tmp_path / "missing.safetensors", tmp_path / "o.safetensors")
    assert res.exit_code == 2


# ----------------------------------------------------------------------------- dry run / CLI
def test_dry_run_prints_the_plan_and_writes_nothing(src, tmp_path):
    dst = tmp_path / "out.safetensors"
    res = run_cli("convert", src, dst, "--dry-run")
    assert res.exit_code == 0, res.output
    assert "blocks.0.attn.qkv_proj" in res.output and "int8_tensorwise convrot g=256" in res.output
    assert "output size" in res.output
    assert leftovers(tmp_path, {"in.safetensors"}) == []
    res = run_cli("convert", src, dst, "--dry-run", "--json")
    plan = json.loads(res.stdout)
    assert plan["counts"]["convert"] == 8
    real = convert(src, dst, ConvertOptions())
    assert plan["output_bytes"] == real.output_bytes == dst.stat().st_size
    # an existing output is only a warning in a dry run (the real run refuses it)
    res = run_cli("convert", src, dst, "--dry-run")
    assert res.exit_code == 0 and "needs --overwrite" in res.output


def test_cli_json_report_file_and_summary(src, tmp_path):
    dst, rep = tmp_path / "out.safetensors", tmp_path / "report.json"
    res = run_cli("convert", src, dst, "--json", "--report", rep)
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    saved = json.loads(rep.read_text())
    assert saved["summary"] == printed["summary"]
    assert saved["summary"]["layers"] == 8
    assert all(lay["metrics"]["output_rel_l2"] < 0.05 for lay in saved["layers"])
    assert "error report" in res.stderr and "worst layer" in res.stderr
    assert leftovers(tmp_path, {"in.safetensors", "out.safetensors", "report.json"}) == []
    res = run_cli("convert", src, tmp_path / "q.safetensors", "--quiet", "--no-report")
    assert res.exit_code == 0 and res.output == ""


# ----------------------------------------------------------------------------- atomicity
def _fail_on_call(monkeypatch, n: int, exc: Exception):
    import h3quant.formats.int8.tensors as int8

    real = int8.encode_int8
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(int8, "encode_int8", flaky)
    return calls


def test_crash_mid_run_leaves_nothing_and_input_intact(src, tmp_path, monkeypatch):
    before = sha(src)
    dst = tmp_path / "out.safetensors"
    _fail_on_call(monkeypatch, 3, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        convert(src, dst, ConvertOptions())
    assert not dst.exists()
    assert leftovers(tmp_path, {"in.safetensors"}) == []
    assert sha(src) == before


def test_failed_layer_exits_1_lists_it_and_writes_nothing(src, tmp_path, monkeypatch):
    dst = tmp_path / "out.safetensors"
    calls = _fail_on_call(monkeypatch, 3, FormatError("weight holds NaN (injected)"))
    with pytest.raises(LayerFailures, match="injected") as info:
        convert(src, dst, ConvertOptions())
    assert info.value.exit_code == 1
    assert calls[0] == 8  # the run went on to list every failing layer
    assert not dst.exists() and leftovers(tmp_path, {"in.safetensors"}) == []
    calls[0] = 0
    res = run_cli("convert", src, dst, "--quiet")
    assert res.exit_code == 1 and "1 layer(s) failed" in res.output
    assert not dst.exists()


def test_nan_weight_is_a_layer_failure(tmp_path):
    t = small_h3(blocks=1)
    t["blocks.0.mlp.fc2.weight"][3, 5] = float("nan")
    src = write(tmp_path / "in.safetensors", t)
    with pytest.raises(LayerFailures, match="blocks.0.mlp.fc2"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions())
    assert leftovers(tmp_path, {"in.safetensors"}) == []


def test_crash_mid_sharded_run_leaves_nothing(tmp_path, monkeypatch):
    from helpers.h3files import make_sharded

    d = make_sharded(tmp_path / "in", small_h3())
    before = sha(d)
    out = tmp_path / "out"
    _fail_on_call(monkeypatch, 5, RuntimeError("injected"))
    with pytest.raises(RuntimeError):
        convert(d, out, ConvertOptions())
    assert not out.exists() and leftovers(tmp_path, {"in"}) == []
    assert sha(d) == before


SIGINT_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import h3quant.formats.int8.tensors as int8
    real = int8.encode_int8
    calls = [0]
    src, dst, flag, workers, nap = sys.argv[1:6]
    def slow(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            Path(flag).write_text("busy")
            time.sleep(float(nap))
        return real(*a, **k)
    int8.encode_int8 = slow
    from h3quant.cli import main
    sys.argv = ["h3quant", "convert", src, dst, "--quiet", "--workers", workers]
    main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("workers, nap", [("1", 60), ("2", 60)])
def test_sigint_mid_run_leaves_nothing(src, tmp_path, workers, nap):
    """SIGINT while a layer is being encoded (in the main thread, or in a worker thread that
    is still busy): exit 130 promptly, no output, no temp file, input unchanged."""
    before = sha(src)
    dst, flag = tmp_path / "out.safetensors", tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_CHILD, str(src), str(dst), str(flag),
                             workers, str(nap)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the temp output exists while the run is in flight
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=40)  # the encoder call sleeps 60 s: no waiting for it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not dst.exists()
    assert leftovers(tmp_path, {"in.safetensors", "flag"}) == []
    assert sha(src) == before


def test_plan_reads_header_only(src, tmp_path, monkeypatch):
    """Planning never reads tensor data (only tiny markers, absent here)."""
    from h3quant.formats.container import reader as container

    def boom(*a, **k):
        raise AssertionError("data read during planning")

    monkeypatch.setattr(container.SafetensorsFile, "read_bytes", boom)
    plan = plan_convert(src, tmp_path / "o.safetensors", ConvertOptions())
    assert plan.output_bytes > 0


def test_refuses_sharded_output_over_the_input_dir_or_its_parent(tmp_path):
    from helpers.h3files import make_sharded

    d = make_sharded(tmp_path / "in", small_h3(blocks=1))
    with pytest.raises(OutputError, match="contains the input"):
        convert(d, tmp_path, ConvertOptions(overwrite=True))
    with pytest.raises(OutputError, match="output is the input"):
        convert(d, d, ConvertOptions(overwrite=True))


def test_offset_writer_any_order_incomplete_and_closed(tmp_path):
    import torch

    from h3quant.formats.container.writer import entry_for, plan_layout, save_tensors
    from h3quant.pipelines.convert.io import OffsetWriter

    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(5, dtype=torch.int8),
               "c": torch.ones(3, dtype=torch.bfloat16)}
    layout = plan_layout([entry_for(n, t) for n, t in tensors.items()], {"k": "v"})
    out = tmp_path / "o.safetensors"
    with OffsetWriter(out, layout) as w:  # reverse order, in pieces
        w.write_tensor("c", tensors["c"])
        w.write_tensor("b", tensors["b"][3:], 3)
        w.write_tensor("b", tensors["b"][:3])
        w.write_tensor("a", tensors["a"])
    save_tensors(tmp_path / "ref.safetensors", tensors, {"k": "v"})
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with pytest.raises(ContainerError, match="incomplete"):
        with OffsetWriter(tmp_path / "x.safetensors", layout) as w:
            w.write_tensor("a", tensors["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors", "ref.safetensors"]
    w = OffsetWriter(tmp_path / "y.safetensors", layout).__enter__()
    w.__exit__(RuntimeError, RuntimeError("x"), None)
    with pytest.raises(ContainerError, match="closed"):
        w.write_tensor("a", tensors["a"])
