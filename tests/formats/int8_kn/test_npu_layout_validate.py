"""validate / inspect of int8_tensorwise_kn layers (FORMATS.md 9), and readers that do not know
the layout refusing it instead of mis-reading the transposed weight."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.forge import cli, codes, expect_error, save, validate

from h3quant.formats.int8_kn.tensors import kn_marker
from h3quant.formats.markers import COMFY_FORMATS, parse_header_metadata

KN = kn_marker()


def kn_layer(name, n=64, k=256, *, scale_shape=None, marker=None, seed=0, scale=None):
    """A kn layer: codes I8 [K, N] in [-127, 127], scale F32 [N] (or ``scale_shape``)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand((n,) if scale_shape is None else scale_shape, generator=g) + 0.01
    if scale is not None:
        s = scale
    from h3quant.formats.markers import marker_tensor

    return {f"{name}.weight": torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8),
            f"{name}.weight_scale": s,
            f"{name}.comfy_quant": marker_tensor(KN if marker is None else marker)}


def test_a_well_formed_kn_file_validates_deep_and_inspects(tmp_path):
    p = save(tmp_path / "ok.safetensors", {**kn_layer("a", n=64, k=256),
                                          **kn_layer("b", n=48, k=256, seed=1)})
    res, doc = validate(p, "--deep")
    assert res.exit_code == 0, doc
    notes = [f for f in doc["findings"] if f["code"] == "Q110"]
    assert [f["tensor"] for f in notes] == ["b.weight"]  # N=48: stays ND, a note
    assert notes[0]["severity"] == "info" and "N=48 % 32 != 0" in notes[0]["message"]
    ins = json.loads(cli("inspect", p, "--layers", "--json").stdout)
    rows = {r["name"]: r for r in ins["layers"]}
    assert (rows["a"]["N"], rows["a"]["K"]) == (64, 256)
    assert (rows["a"]["layout"], rows["a"]["nz"]) == ("npu", True)
    assert (rows["b"]["layout"], rows["b"]["nz"]) == ("npu", False)
    text = cli("inspect", p, "--layers").stdout
    assert "int8_tensorwise_kn" in text and "no (ND)" in text and " npu " in text


@pytest.mark.parametrize("shape,why", [((256,), "K=256 values"), ((64, 1), "not 1-D"),
                                       ((7,), "7 values")])
def test_kn_scale_must_be_n(tmp_path, shape, why):
    p = save(tmp_path / "bad.safetensors", kn_layer("a", n=64, k=256, scale_shape=shape))
    doc = expect_error(p, "Q109")
    f = next(f for f in doc["findings"] if f["code"] == "Q109")
    assert f["tensor"] == "a.weight_scale" and why in f["message"] and "[64]" in f["message"]
    assert "Q103" not in codes(doc)  # one finding per problem


def test_canonical_weight_under_a_kn_marker_is_named(tmp_path):
    """An [N, K] weight with its [N] scale but a kn marker: the scale has K values of the
    stored [K', N'] reading, and the finding says the weight looks canonical."""
    g = torch.Generator().manual_seed(4)
    from h3quant.formats.markers import marker_tensor

    t = {"a.weight": torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8),
         "a.weight_scale": torch.rand(64, generator=g) + 0.01,
         "a.comfy_quant": marker_tensor(KN)}
    doc = expect_error(save(tmp_path / "c.safetensors", t), "Q109")
    assert "looks stored canonical" in json.dumps(doc)


def test_kn_k_must_divide_by_the_group(tmp_path):
    p = save(tmp_path / "g.safetensors", kn_layer("a", n=64, k=128 + 64))
    doc = expect_error(p, "Q104")
    assert any("K=192" in f["message"] for f in doc["findings"] if f["code"] == "Q104")


def test_kn_n_over_the_npu_limit_warns_with_a_tp_degree(tmp_path):
    p = save(tmp_path / "wide.safetensors",
             kn_layer("a", n=86016, k=16, marker={"format": "int8_tensorwise_kn"}))
    res, doc = validate(p)
    assert res.exit_code == 0
    (f,) = [f for f in doc["findings"] if f["code"] == "Q111"]
    assert f["severity"] == "warning" and "tensor parallelism over 2 ranks" in f["message"]
    assert "43008 per rank" in f["message"]


@pytest.mark.parametrize("value,code", [(float("nan"), "D101"), (0.0, "D102"), (-1.0, "D102")])
def test_kn_scales_finite_and_positive_with_deep(tmp_path, value, code):
    s = torch.rand(64) + 0.01
    s[5] = value
    p = save(tmp_path / "s.safetensors", kn_layer("a", n=64, k=256, scale=s))
    res, doc = validate(p)
    assert res.exit_code == 0  # header-only: fine
    doc = expect_error(p, code, "--deep")
    f = next(f for f in doc["findings"] if f["code"] == code)
    assert f["tensor"] == "a.weight_scale" and "flat index 5" in f["message"]


def test_codes_lists_the_kn_rules():
    out = cli("validate", "--codes").stdout
    for code in ("Q109", "Q110", "Q111"):
        assert code in out


# ------------------------------------------------------------------------- foreign readers


def test_the_kn_format_is_unknown_to_comfyui_and_kitchen(tmp_path):
    """A loader that knows only ComfyUI's format names (FORMATS.md 2: an unknown format makes
    the loader fail) refuses every kn layer; comfy-kitchen registers no layout for it."""
    from h3quant.formats.container.checkpoint import Checkpoint

    p = save(tmp_path / "kn.safetensors", kn_layer("a", n=64, k=256))
    with Checkpoint(p) as ck:
        layers = parse_header_metadata(ck.metadata)
        marker = json.loads(bytes(ck.read("a.comfy_quant").numpy()))
    comfy_names = {f.value for f in COMFY_FORMATS}
    assert "int8_tensorwise" in comfy_names
    assert layers["a"]["format"] not in comfy_names and marker["format"] not in comfy_names
    kitchen = pytest.importorskip("comfy_kitchen.tensor")
    registered = " ".join(n.lower() for n in dir(kitchen) if n.endswith("Layout"))
    assert "tensorwiseint8layout" in registered and "_kn" not in registered


def test_a_plain_int8_reading_of_a_square_kn_layer_would_be_silently_wrong():
    """Why the layout needs its own name: kitchen's TensorWiseINT8Layout accepts a square kn
    layer's tensors (every shape check passes) and computes with the transposed weight."""
    ck = pytest.importorskip("comfy_kitchen.tensor")
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    from h3quant.formats.int8.tensors import decode_int8, encode_int8

    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(8))
    q, s = encode_int8(w, convrot=True, group_size=256)
    kn_q, kn_s = q.t().contiguous(), s.reshape(-1)
    params = TensorWiseINT8Layout.Params(scale=kn_s.reshape(-1, 1), orig_dtype=torch.float32,
                                         orig_shape=tuple(kn_q.shape), convrot=True,
                                         convrot_groupsize=256)
    wrong = ck.QuantizedTensor(kn_q, "TensorWiseINT8Layout", params).dequantize().float()
    right = decode_int8(q, s, convrot=True, group_size=256)
    assert wrong.shape == right.shape  # nothing complains ...
    assert ((wrong - right).norm() / right.norm()).item() > 0.5  # ... and the weight is wrong


def test_header_only_commands_on_a_kn_file_do_not_import_torch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    p = save(tmp_path / "kn.safetensors", {**kn_layer("a", n=64, k=256),
                                          **kn_layer("b", n=48, k=256, seed=1)})
    code = ("import sys; from h3quant.pipelines.headers.inspect import inspect_checkpoint; "
            "from h3quant.pipelines.headers.validate import validate_checkpoint; "
            f"r = inspect_checkpoint({str(p)!r}, layers=True); "
            f"v = validate_checkpoint({str(p)!r}); "
            "assert [x['nz'] for x in r.layers] == [True, False], r.layers; "
            "assert 'Q110' in {f.code for f in v.findings}; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[3], check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
