"""The output rules hold for the commands and options added beside convert / verify / plan:
``capture`` (its statistics), ``compare`` (markdown, plot) and ``convert --calibration``. An
output that names any file the command reads is refused with exit 2, before any work, and the
input's bytes are unchanged."""

from __future__ import annotations

import hashlib

import pytest
import torch

from helpers.forge import cli


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3quant.calibration.recorder import write_inputs
    from h3quant.runtime.model.model import H3Model
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("io")
    m = d / "m.safetensors"
    synth_checkpoint(m, preset="tiny", blocks=1, seed=0)
    q = d / "q.safetensors"
    assert cli("convert", m, q, "--to", "int8-convrot", "-q", "--no-report").exit_code == 0
    i = d / "i.safetensors"
    with H3Model.open(m) as model:
        g = torch.Generator().manual_seed(0)
        write_inputs(i, torch.randn(1, model.video_channels, 1, 8, 8, generator=g),
                     torch.randn(1, model.audio_channels, 2, 8, generator=g),
                     torch.randn(1, 16, model.text_dim, generator=g), 0.5)
    s = d / "s.stats"
    assert cli("capture", m, "--inputs", i, "--out", s).exit_code == 0
    return {"m": m, "q": q, "i": i, "s": s}


@pytest.mark.parametrize("argv, victim", [
    (["capture", "{m}", "--inputs", "{i}", "--out", "{i}"], "i"),
    (["capture", "{m}", "--inputs", "{i}", "--out", "{m}"], "m"),
    (["capture", "{m}", "--inputs", "{i}", "--through", "{q}", "--out", "{q}"], "q"),
    (["compare", "{q}", "--reference", "{m}", "--steps", "0", "--markdown", "{q}"], "q"),
    (["compare", "{q}", "--reference", "{m}", "--steps", "0", "--plot", "{m}"], "m"),
    (["compare", "{q}", "--reference", "{m}", "--steps", "0", "--inputs", "{i}",
      "--markdown", "{i}"], "i"),
    (["convert", "{m}", "{q}.out", "--to", "int8-convrot", "--calibration", "{s}",
      "--report", "{s}"], "s"),
    (["convert", "{m}", "{s}", "--to", "int8-convrot", "--calibration", "{s}",
      "--overwrite"], "s"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_no_output_names_an_input(files, argv, victim):
    before = {k: _sha(p) for k, p in files.items()}
    res = cli(*[a.format(**files) for a in argv])
    assert res.exit_code == 2, res.output
    assert "a file this command reads" in res.output or "is the input" in res.output, res.output
    assert {k: _sha(p) for k, p in files.items()} == before, f"{victim} changed"
