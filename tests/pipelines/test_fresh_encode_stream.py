"""The fresh encode behind relative verdicts is planned from headers and streamed into its
temporary file one layer at a time, whatever the reference's size: the same tensors, figures
and verdicts as an encode built whole in memory (written here by the safetensors library), one
layer in flight, the size said first, a clear fallback when the temporary folder is too small,
and nothing left behind after success, an error or SIGTERM."""

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
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from bench_verdicts import kitchen_file  # noqa: E402

from helpers.cli import SMALL  # noqa: E402

from h3quant.cli import main  # noqa: E402
from h3quant.pipelines import fresh_encode as fe  # noqa: E402
from h3quant.sizes import size_text  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("stream")
    ref = d / "bf16.safetensors"
    synth_checkpoint(ref, preset="tiny", blocks=2, seed=7, workers=1)
    return {"ref": ref, "nvfp4": kitchen_file(ref, d / "nvfp4.safetensors", "nvfp4"),
            "int8": kitchen_file(ref, d / "int8.safetensors", "int8-convrot")}


def _in_memory_encode(file: Path, ref: Path, out: Path) -> None:
    """The encode as it was built before: every layer encoded and held, then one save by the
    safetensors library (its own order)."""
    from h3quant.formats import registry
    from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor

    layers = fe.file_layers(str(file))[0]
    tensors = load_file(str(ref))
    header = {}
    for layer, fields in layers.items():
        w = tensors.pop(layer + ".weight")
        codec = registry.codec_for(fields, tensor=layer + ".weight")
        for suffix, value in codec.encoder.encode(w.float(), fields, "exact").items():
            tensors[f"{layer}.{suffix}"] = value.contiguous()
        tensors[layer + ".comfy_quant"] = marker_tensor(fields)
        header[layer] = fields
    save_file(tensors, str(out), {HEADER_KEY: header_metadata_value(header)})


def _verify_dict(path: Path, ref: Path, model: bool) -> dict:
    if model:
        from h3quant.pipelines.verify.model import verify_model

        return verify_model(path, reference=ref, device="cpu", expected=False).to_dict()
    from h3quant.pipelines.verify.blocks import verify_checkpoint

    return verify_checkpoint(path, reference=ref, device="cpu", expected=False).to_dict()


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_the_streamed_encode_equals_the_in_memory_one_in_tensors_and_figures(files, tmp_path,
                                                                             monkeypatch, fmt):
    monkeypatch.setattr(fe, "NATIVE_DTYPES", {})  # the float32 encode only, as before
    streamed, whole = tmp_path / "streamed.safetensors", tmp_path / "whole.safetensors"
    enc = fe.write_fresh_encode(str(files[fmt]), str(files["ref"]), str(streamed))
    assert enc.complete and len(enc.encoded) == 8
    _in_memory_encode(files[fmt], files["ref"], whole)
    a, b = load_file(str(streamed)), load_file(str(whole))
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].reshape(-1), b[k].reshape(-1)
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k
    for model in (False, True):
        got, want = _verify_dict(streamed, files["ref"], model), _verify_dict(whole, files["ref"],
                                                                              model)
        for d in (got, want):
            d.pop("checkpoint", None)
            d.pop("path", None)
        assert json.dumps(got, sort_keys=True, default=str) == json.dumps(
            want, sort_keys=True, default=str)


def test_one_layer_is_in_flight_and_written_before_the_next_is_encoded(files, tmp_path,
                                                                       monkeypatch):
    from h3quant.formats.container import writer

    events: list[str] = []
    real_encode, real_write = fe._encode, writer.StreamingWriter.write_tensor

    def encode(job, ref, *rest):
        events.append("encode " + job.layer)
        return real_encode(job, ref, *rest)

    def write(self, name, tensor):
        events.append("write " + name)
        return real_write(self, name, tensor)

    monkeypatch.setattr(fe, "_encode", encode)
    monkeypatch.setattr(writer.StreamingWriter, "write_tensor", write)
    enc = fe.write_fresh_encode(str(files["int8"]), str(files["ref"]),
                                str(tmp_path / "e.safetensors"))
    assert len(enc.encoded) == 8
    encodes = [i for i, e in enumerate(events) if e.startswith("encode")]
    assert len(encodes) == 8
    for i, j in zip(encodes, encodes[1:] + [len(events)]):
        layer = events[i].split()[1]
        # everything between one encode and the next is that layer's own tensors
        assert [e.split()[1].rsplit(".", 1)[0] for e in events[i + 1:j]] == [layer] * 3, events


def test_the_size_is_said_first_and_a_small_temporary_folder_falls_back_by_name(
        files, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    said: list[str] = []
    out = tmp_path / "e.safetensors"
    enc = fe.write_fresh_encode(str(files["nvfp4"]), str(files["ref"]), str(out),
                                log=said.append)
    size = out.stat().st_size
    assert len(said) == 1 and size_text(size) in said[0], said
    out.unlink()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(size, size - 1000, 1000))
    enc = fe.write_fresh_encode(str(files["nvfp4"]), str(files["ref"]), str(out))
    assert enc.path is None and not out.exists() and len(enc.skipped) == 8
    why = enc.describe()
    assert str(tmp_path) in why and size_text(size) in why and "TMPDIR" in why
    assert "fixed per-format limits" in why
    r = CliRunner().invoke(main, ["verify", str(files["nvfp4"]), "--reference",
                                  str(files["ref"]), "--model", *SMALL, "--json"])
    assert "Traceback" not in r.output
    doc = json.loads(r.stdout)
    assert doc["expected"] is None and all(o["limit_db"] == 9.0 for o in doc["outputs"])
    assert any("needs" in n and "TMPDIR" in n for n in doc["notes"]), doc["notes"]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("cmd", [["verify"], ["verify", "--model"]])
def test_nothing_is_left_after_success_or_an_error_and_inputs_are_untouched(files, tmp_path,
                                                                            monkeypatch, cmd):
    import hashlib
    import tempfile

    # the temporary folder is the inputs' own folder: no output may land on an input
    monkeypatch.setattr(tempfile, "tempdir", str(files["ref"].parent))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in files["ref"].parent.iterdir()}
    args = [*cmd, str(files["int8"]), "--reference", str(files["ref"]), "--json",
            *(SMALL if "--model" in cmd else ["--device", "cpu"])]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "encoded afresh" in r.stdout
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in files["ref"].parent.iterdir()}
    assert after == before

    def boom(*a, **k):
        raise MemoryError("no room")

    monkeypatch.setattr(fe, "_encode", boom)  # fails while the temporary file is half written
    with pytest.raises(MemoryError):
        fe.judged_encode(str(files["int8"]), str(files["ref"]), lambda p: None)
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError):  # fails while the verifier runs on it
        fe.judged_encode(str(files["int8"]), str(files["ref"]),
                         lambda p: (_ for _ in ()).throw(RuntimeError(p)))
    assert _leftovers(tmp_path) == []
    assert {p.name for p in files["ref"].parent.iterdir()} == set(before)


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from h3quant.pipelines import fresh_encode as fe
    from h3quant.pipelines.verify import model
    flag, stage = Path(sys.argv[1]), sys.argv[2]
    real_encode, real_verify = fe._encode, model.verify_model
    calls = []
    def encode(job, ref, *rest):
        calls.append(job.layer)
        if stage == "encode" and len(calls) == 3:
            flag.write_text("busy")
            time.sleep(60)
        return real_encode(job, ref, *rest)
    def verify(*a, **k):
        if stage == "verify" and not k.get("expected", True):
            flag.write_text("busy")
            time.sleep(60)
        return real_verify(*a, **k)
    fe._encode, model.verify_model = encode, verify
    from h3quant.cli import main
    sys.argv = ["h3quant", "verify", *sys.argv[3:]]
    main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["encode", "verify"])
def test_sigterm_removes_the_temporary_encode(files, tmp_path, stage):
    tmp, flag = tmp_path / "tmp", tmp_path / "flag"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(flag), stage, str(files["int8"]),
                             "--reference", str(files["ref"]), "--model", *SMALL, "-q"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [work] = list(tmp.iterdir())  # the encode's folder, its file there (or staged)
        assert work.name.startswith("h3quant-expected-") and list(work.iterdir())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert _leftovers(tmp) == []
