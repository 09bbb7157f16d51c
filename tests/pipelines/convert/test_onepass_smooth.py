"""``convert --calibrate-on --smooth auto``: block b's smoothing chosen from block b's statistics
and folded as ``convert --calibration S --smooth auto`` does: the same bytes as capture + that
convert on a tiny synthetic checkpoint (where some layers are smoothed), resumed too."""

import json

import pytest

from h3quant.errors import ConvertError
from h3quant.formats.container.reader import SafetensorsFile
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.convert.onepass import work_dir
from helpers.inputs import synth_world

TARGET = "int4-convrot"  # 4-bit activations: smoothing pays on the synthetic weights


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return synth_world(tmp_path_factory.mktemp("onepass_smooth"), 5, 5)


def _file(path) -> tuple[dict, dict]:
    with SafetensorsFile(path, mmap=False) as fh:
        return ({n: fh.read_bytes(i, 0, i.nbytes) for n, i in fh.tensors.items()},
                dict(fh.metadata))


def _forget_choices():
    from h3quant.pipelines.convert import smoothing

    smoothing._CHOSEN.clear()  # each run searches for itself


def test_one_pass_smoothing_equals_capture_then_convert(world):
    from h3quant.pipelines.capture import capture_statistics

    d, src = world["d"], world["src"]
    capture_statistics(src, world["inputs"], d / "a.stats", predict=False)
    two = d / "two.safetensors"
    _forget_choices()
    ref = convert(src, two, ConvertOptions(target=TARGET, calibration=str(d / "a.stats"),
                                           smooth="auto"))
    smoothed = sorted(n for n, e in ref.extra["smoothing"].items() if e["smoothed"])
    assert smoothed  # the comparison below covers folded tensors
    _forget_choices()
    one = d / "one.safetensors"
    rep = convert(src, one, ConvertOptions(target=TARGET, calibrate_on=(world["calib"],),
                                           smooth="auto"))
    t1, m1 = _file(one)
    t2, m2 = _file(two)
    assert t1 == t2
    assert {k for k in set(m1) | set(m2) if m1.get(k) != m2.get(k)} == {"h3quant.options"}
    assert json.loads(m1["h3quant.smoothing"]) == smoothed
    assert rep.extra["smoothing"] == ref.extra["smoothing"]
    assert json.loads(m1["h3quant.options"])["smooth"] == "auto"
    assert not work_dir(one).exists()
    # stopped after block 1 and resumed: the factors of block 1 come back from its file
    _forget_choices()
    again = d / "again.safetensors"
    opts = ConvertOptions(target=TARGET, calibrate_on=(world["calib"],), smooth="auto")
    from h3quant.pipelines.convert.onepass import onepass_convert

    assert onepass_convert(src, again, opts, convert_fn=convert, stop_after=1) is None
    _forget_choices()
    convert(src, again, opts)
    assert _file(again)[0] == t2


def test_smoothing_needs_float_feedback(world):
    with pytest.raises(ConvertError, match="--feedback float"):
        ConvertOptions(target=TARGET, calibrate_on=(world["calib"],), smooth="auto",
                       feedback="quantized")
