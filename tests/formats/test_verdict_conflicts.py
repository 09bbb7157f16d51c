"""One verdict: a file whose per-layer markers and header metadata disagree, and a W4A8 layer
whose codebook is broken, are error findings for validate and refused by convert (exit 1,
nothing written), verify (exit 1) and the Python API alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.h3files import read_all, resave, sha

from h3quant.errors import FindingError
from h3quant.formats.markers import HEADER_KEY, header_metadata_value, parse_header_metadata

pytestmark = pytest.mark.slow  # whole-model / verify runs on module-wide files: the slow subset


def cli(*args):
    from click.testing import CliRunner

    from h3quant.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("verdict")
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1, seed=5)
    int8, w4a8 = d / "int8.safetensors", d / "w4a8.safetensors"
    convert(bf16, int8, ConvertOptions(report=False))
    convert(bf16, w4a8, ConvertOptions(target="w4a8", report=False, workers=1))
    return {"bf16": bf16, "int8": int8, "w4a8": w4a8}


def _disagreeing(files, tmp_path) -> tuple[Path, str]:
    _, meta, _ = read_all(files["int8"])
    layers = parse_header_metadata(meta)
    victim = sorted(layers)[0]
    layers[victim] = dict(layers[victim], convrot=False)  # the tensor marker says convrot=true
    bad = resave(files["int8"], tmp_path / "bad.safetensors",
                  metadata=dict(meta, **{HEADER_KEY: header_metadata_value(layers)}))
    return bad, victim


def _broken_codebook(files, tmp_path, how: str) -> tuple[Path, str]:
    victim = []

    def edit(tensors, meta):
        name = sorted(n for n in tensors if n.endswith(".weight_codebook"))[0]
        victim.append(name)
        cb = tensors[name].clone()
        if how == "unsorted":
            cb = cb.flip(0)
        elif how == "nan":
            cb[3] = float("nan")
        else:  # out of range
            cb = cb * 4
        tensors[name] = cb

    bad = resave(files["w4a8"], tmp_path / f"cb_{how}.safetensors", edit=edit)
    return bad, victim[0]


def _assert_refused_everywhere(bad: Path, code: str, tensor: str, tmp_path: Path, targets):
    from h3quant.pipelines.convert import ConvertOptions, LayerFailures, convert
    from h3quant.pipelines.headers.validate import validate_checkpoint as validate

    before = sha(bad)
    # validate (header-only or deep) reports it as an error finding: exit 1
    res = cli("validate", bad, "--deep")
    assert res.exit_code == 1 and code in res.output, res.output
    found = [f for f in validate(bad, deep=True).findings if f.code == code]
    assert found and tensor in (found[0].tensor or "")
    # convert refuses it whatever the target: exit 1, nothing written
    for target in targets:
        out = tmp_path / f"out-{target}.safetensors"
        res = cli("convert", bad, out, "--to", target, "--workers", "1")
        assert res.exit_code == 1, (target, res.output)
        assert code in res.output and not out.exists(), (target, res.output)
        # the API: the rule's finding itself (header rules, at plan time) or the layer's
        # failure naming it (data rules, read while converting); exit status 1 either way
        with pytest.raises((FindingError, LayerFailures)) as err:
            convert(bad, out, ConvertOptions(target=target, workers=1))
        assert err.value.exit_code == 1 and code in str(err.value)
        assert not out.exists()
    # verify refuses it too: exit 1 (the input is wrong), naming the rule
    res = cli("verify", bad, "--device", "cpu", "--blocks", "1")
    assert res.exit_code == 1 and code in res.output, res.output
    assert sha(bad) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out-")]


def test_marker_and_header_disagreement_is_one_verdict(files, tmp_path):
    bad, victim = _disagreeing(files, tmp_path)
    _assert_refused_everywhere(bad, "M110", victim, tmp_path, ["int8-convrot", "bf16"])


@pytest.mark.parametrize("how", ["unsorted", "nan", "range"])
def test_broken_w4a8_codebook_is_one_verdict(files, tmp_path, how):
    bad, victim = _broken_codebook(files, tmp_path, how)
    _assert_refused_everywhere(bad, "D104", victim, tmp_path, ["bf16", "int8", "w4a8"])


def test_a_sound_w4a8_file_still_converts(files, tmp_path):
    """The refusals are specific: the same file with its codebook intact converts."""
    from h3quant.pipelines.convert import ConvertOptions, convert

    out = tmp_path / "back.safetensors"
    convert(files["w4a8"], out, ConvertOptions(target="bf16", report=False))
    assert out.exists()
    t, _, _ = read_all(out)
    assert all(v.dtype != torch.int8 for v in t.values())
