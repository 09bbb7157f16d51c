"""``verify --tp N --reference FLOAT`` runs: the sharded run against one device and the float
reference against one device, with the verdicts of the plain ``verify --reference``; and every
usage error of ``verify --tp`` is reported before any rank starts."""

import json
import time

import pytest
from click.testing import CliRunner

from h3quant.cli import main

pytestmark = pytest.mark.slow  # processes / tensor-parallel ranks: the slow subset


@pytest.fixture(scope="module")
def files(tp_files):
    return tp_files


@pytest.fixture(scope="module")
def foreign(files):
    """A float file of the same shapes but other weights: not what int8 was made from."""
    from h3quant.synth import synth_checkpoint

    path = files["dir"] / "other_bf16.safetensors"
    synth_checkpoint(path, preset="tiny", blocks=1, seed=7)
    return path


def _json(*args):
    r = CliRunner().invoke(main, ["verify", *map(str, args), "--json"])
    return r.exit_code, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else r.output)


def _verdicts(d: dict) -> dict:
    """What verify --reference decides: every layer's and block's figures and pass/fail."""
    return {"layers": [(x["name"], x["path"], round(x["rel_err"], 9), x["passed"])
                       for x in d["layers"]],
            "blocks": [(b["index"], round(b["sqnr_db"], 6), b["passed"])
                       for b in d["block_checks"]],
            "passed": d["passed"], "failures": d["failures"]}


@pytest.mark.parametrize("fmt,tp", [("int8", 2), ("w4a8", 2)])
def test_tp_with_reference_gives_the_plain_verdicts_too(files, fmt, tp):
    common = (files[fmt], "--reference", files["bf16"], "--blocks", "1", "--tokens", "8")
    code, res = _json(*common, "--tp", tp, "--tp-timeout", 60)
    assert code == 0, res
    assert res["passed"] and res["tp"] == tp
    assert all(c["identical"] for c in res["checks"])  # sharded == one device, bit for bit
    plain_code, plain = _json(*common)
    assert plain_code == 0, plain
    assert _verdicts(res["reference"]) == _verdicts(plain)


def test_tp_with_a_foreign_reference_fails_like_plain_verify(files, foreign):
    common = (files["int8"], "--reference", foreign, "--blocks", "1", "--tokens", "8")
    code, res = _json(*common, "--tp", 2, "--tp-timeout", 60)
    plain_code, plain = _json(*common)
    assert plain_code == 1 and plain["failures"], plain
    assert code == 1, res
    assert all(c["passed"] for c in res["checks"])  # the sharding itself is fine
    assert res["failures"] == [f"vs the float reference: {f}" for f in plain["failures"]]
    assert _verdicts(res["reference"]) == _verdicts(plain)


def test_tp_model_with_reference(files):
    args = ("--model", "--height", "4", "--width", "4", "--audio-frames", "4",
            "--text-tokens", "8", "--reference", files["bf16"])
    code, res = _json(files["int8"], *args, "--tp", 2, "--tp-timeout", 60)
    assert code == 0, res
    plain_code, plain = _json(files["int8"], *args)
    assert plain_code == 0, plain
    assert res["reference"]["outputs"] == plain["outputs"]
    assert res["reference"]["passed"] is True


def test_tp_reference_text_output(files):
    r = CliRunner().invoke(main, ["verify", str(files["int8"]), "--tp", "2", "--reference",
                                  str(files["bf16"]), "--blocks", "1", "--tokens", "8"])
    assert r.exit_code == 0, r.output
    assert "vs the float reference" in r.output and "blocks.0.attn.qkv_proj" in r.output


# ----------------------------------------------------------- usage errors: before any rank


def _usage_cases(files, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 3)
    missing = tmp_path / "absent.safetensors"
    i8, bf = str(files["int8"]), str(files["bf16"])
    return [
        ([missing, "--tp", "2"], "no such file"),
        ([i8, "--tp", "2", "--reference", missing], "no such file"),
        ([i8, "--tp", "2", "--reference", junk], str(junk)),
        ([junk, "--tp", "2", "--reference", bf], str(junk)),
        ([i8, "--tp", "2", "--device", "cuda"], "no cuda device is available"),
        ([i8, "--tp", "2", "--device", "npu"], "no npu device is available"),
        ([i8, "--tp", "2", "--device", "mps"], "no mps device is available"),
        ([i8, "--tp", "2", "--device", "gpu"], "invalid device"),
        ([i8, "--tp", "3"], "does not divide the 4 attention heads"),
        ([i8, "--tp", "0"], "--tp"),
        ([i8, "--tp", "2", "--model", "--steps", "4"], "--steps cannot be used"),
        ([i8, "--tp", "2", "--plot", tmp_path / "p.png", "--model"], "--plot cannot be used"),
        ([i8, "--tp", "2", "--model", "--blocks", "1"], "--blocks cannot be used"),
        ([i8, "--tp", "2", "--frames", "2"], "--frames cannot be used"),
        ([i8, "--tp-scale", "per-rank"], "--tp-scale cannot be used"),
        ([i8, "--tp", "2", "--tp-timeout", "0"], "--tp-timeout"),
    ]


def test_every_usage_error_comes_before_any_rank_starts(files, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr("h3quant.runtime.tp.launch.spawn_ranks",
                        lambda *a, **k: started.append("spawn"))
    monkeypatch.setattr("h3quant.runtime.tp.launch.join_torchrun",
                        lambda *a, **k: started.append("join"))
    monkeypatch.setattr("h3quant.runtime.tp.launch.init_group",
                        lambda *a, **k: started.append("init"))
    for args, says in _usage_cases(files, tmp_path):
        if "--device" in args and args[args.index("--device") + 1] in ("cuda", "npu", "mps"):
            from h3quant.runtime.capabilities import live_probe

            if live_probe().device_available(args[args.index("--device") + 1]):
                continue  # only a device this machine lacks is an error
        t0 = time.monotonic()
        r = CliRunner().invoke(main, ["verify", *map(str, args)])
        took = time.monotonic() - t0
        assert r.exit_code == 2, (args, r.output)
        assert says in r.output, (args, r.output)
        assert "Traceback" not in r.output
        assert not started, (args, started)
        assert took < 10, (args, took)  # header reads only: no rank start-up


def test_a_usage_error_starts_no_process(files, tmp_path):
    """From outside: the command returns 2 with the message, and spawned no child process
    (counted through the multiprocessing start hook in a wrapper)."""
    import subprocess
    import sys

    wrapper = ("import sys, torch.multiprocessing as mp\n"
               "def refuse(*a, **k):\n"
               "    print('SPAWNED', file=sys.stderr); raise SystemExit(99)\n"
               "mp.start_processes = refuse\n"
               "from h3quant.cli import main\n"
               "sys.argv = ['h3quant'] + sys.argv[1:]\n"
               "main()\n")
    p = subprocess.run([sys.executable, "-c", wrapper, "verify", str(files["int8"]), "--tp", "2",
                        "--reference", str(tmp_path / "absent.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "no such file" in p.stderr and "SPAWNED" not in p.stderr
