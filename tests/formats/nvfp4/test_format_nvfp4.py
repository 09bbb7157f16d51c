"""nvfp4: bytes equal to comfy-kitchen's quantizer, kitchen-written files read clean, bad files
get findings."""

import os

import pytest
import torch

from helpers.forge import cli, codes, validate
from helpers.kitchen_files import block_linear_names, kitchen_file, kitchen_quantize, marker_tensor, read_all
from h3quant.formats.nvfp4.tensors import decode_nvfp4, encode_nvfp4
from h3quant.synth import synth_checkpoint

ck = pytest.importorskip("comfy_kitchen")
LAYOUT = "TensorCoreNVFP4Layout"


def _weight(n, k, seed=0, dtype=torch.bfloat16, rows=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, k, generator=g))
    if rows:  # per-row magnitudes, as real weights have
        w = w * torch.exp(1.5 * torch.randn(n, 1, generator=g))
    return w.to(dtype)


@pytest.mark.parametrize("shape", [(256, 512), (128, 64), (100, 200), (7, 33), (300, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_encode_is_kitchens_bytes(shape, dtype):
    w = _weight(*shape, dtype=dtype)
    w[1] = 0  # a zero row
    w[2, :16] = -0.0
    ref = kitchen_quantize(w, LAYOUT)
    out = encode_nvfp4(w)
    assert torch.equal(out["weight"], ref["weight"])
    assert out["weight_scale"].dtype == ref["weight_scale"].dtype == torch.float8_e4m3fn
    assert out["weight_scale"].shape == ref["weight_scale"].shape
    assert torch.equal(out["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert out["weight_scale_2"].dtype == torch.float32
    assert torch.equal(out["weight_scale_2"], ref["weight_scale_2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_kitchens_dequantize(dtype):
    w = _weight(200, 160, seed=3)
    out = encode_nvfp4(w)
    want = ck.dequantize_nvfp4(out["weight"], out["weight_scale_2"], out["weight_scale"], dtype)
    got = decode_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"], dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("nvfp4") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=2, seed=5)
    return p


def test_convert_writes_kitchens_bytes_for_every_layer(src, tmp_path):
    out = tmp_path / "nvfp4.safetensors"
    res = cli("convert", src, out, "--to", "nvfp4", "-q")
    assert res.exit_code == 0, res.output
    a, b = read_all(src), read_all(out)
    names = block_linear_names(a)
    assert len(names) == 8
    for name in names:
        ref = kitchen_quantize(a[name + ".weight"], LAYOUT)
        for suffix, want in ref.items():
            got = b[f"{name}.{suffix}"]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, suffix)
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               want.reshape(-1).view(torch.uint8)), (name, suffix)
        assert bytes(b[name + ".comfy_quant"].tolist()) == b'{"format": "nvfp4"}'
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0 and not doc["findings"], doc["findings"]


@pytest.fixture(scope="module")
def kitchen_made(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("nvfp4k") / "kitchen.safetensors"
    return kitchen_file(src, out, LAYOUT, {"format": "nvfp4"})


def test_a_kitchen_file_inspects_and_validates_clean(kitchen_made):
    res, doc = validate(kitchen_made, "--deep")
    assert res.exit_code == 0, doc["findings"]
    # markers as tensors only (the header has no copy): M113's warning, nothing else
    assert codes(doc) <= {"M113"} and doc["counts"]["error"] == 0
    res = cli("inspect", kitchen_made, "--layers")
    assert res.exit_code == 0 and "nvfp4" in res.output


def test_a_kitchen_file_decodes_to_kitchens_dequantize(kitchen_made, tmp_path):
    out = tmp_path / "back.safetensors"
    res = cli("convert", kitchen_made, out, "--to", "bf16", "-q")
    assert res.exit_code == 0, res.output
    k, b = read_all(kitchen_made), read_all(out)
    for name in block_linear_names(b):
        want = ck.dequantize_nvfp4(k[name + ".weight"], k[name + ".weight_scale_2"],
                                   k[name + ".weight_scale"], torch.float32)
        assert torch.equal(b[name + ".weight"], want.bfloat16()), name


def test_from_nvfp4_to_int8_convrot_and_back_to_nvfp4(kitchen_made, tmp_path):
    out = tmp_path / "i8.safetensors"
    res = cli("convert", kitchen_made, out, "--to", "int8-convrot", "-q")
    assert res.exit_code == 0, res.output
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0, doc["findings"]


# ----------------------------------------------------------------------------- bad files


def _one_layer(tmp_path, mutate, n=256, k=512):
    w = _weight(n, k, seed=9)
    t = kitchen_quantize(w, LAYOUT)
    tensors = {f"lin.{s}": v for s, v in t.items()}
    tensors["lin.comfy_quant"] = marker_tensor({"format": "nvfp4"})
    mutate(tensors)
    from safetensors.torch import save_file

    p = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(p))
    return p


def _set_scale_byte(t, value):
    s = t["lin.weight_scale"].view(torch.uint8).clone()
    s[3, 5] = value
    t["lin.weight_scale"] = s.view(torch.float8_e4m3fn)


def _unswizzle(t):
    from comfy_kitchen.float_utils import from_blocked

    s = t["lin.weight_scale"].view(torch.uint8)
    t["lin.weight_scale"] = from_blocked(s, s.shape[0], s.shape[1]).contiguous().view(
        torch.float8_e4m3fn)


@pytest.mark.parametrize("mutate, code, deep", [
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"].float()}), "Q102", False),
    (lambda t: t.update({"lin.weight_scale": t["lin.weight_scale"][:, :8].contiguous()}), "Q103", False),
    (lambda t: t.pop("lin.weight_scale_2"), "Q101", False),
    (lambda t: t.update({"lin.weight_scale_2": t["lin.weight_scale_2"].half()}), "Q102", False),
    (lambda t: t.update({"lin.weight": t["lin.weight"][:250].contiguous()}), "Q120", False),
    (lambda t: t.update({"lin.weight": t["lin.weight"].view(torch.int8)}), "Q102", False),
    (lambda t: t.update({"lin.weight_zeros": torch.zeros(3)}), "Q106", False),
    (lambda t: t.update({"lin.weight_scale_2": torch.tensor(float("nan"))}), "D101", True),
    (lambda t: t.update({"lin.weight_scale_2": torch.tensor(float("inf"))}), "D101", True),
    (lambda t: t.update({"lin.weight_scale_2": torch.tensor(0.0)}), "D102", True),
    (lambda t: t.update({"lin.weight_scale_2": torch.tensor(-1.0)}), "D102", True),
    (lambda t: _set_scale_byte(t, 0x7F), "D120", True),  # NaN
    (lambda t: _set_scale_byte(t, 0xB8), "D120", True),  # -1.0
    (lambda t: _set_scale_byte(t, 0x00), "D120", True),  # zero over non-zero codes
    (_unswizzle, "D121", True),
])
def test_bad_files_get_findings(tmp_path, mutate, code, deep):
    p = _one_layer(tmp_path, mutate)
    res, doc = validate(p, *(["--deep"] if deep else []))
    assert code in codes(doc), doc["findings"]
    assert res.exit_code == (0 if code == "Q106" else 1)  # Q106 is a warning
    if not deep:  # header findings come without reading data too
        res, doc2 = validate(p)
        assert code in codes(doc2)


def test_the_right_layout_is_not_called_unswizzled(tmp_path):
    res, doc = validate(_one_layer(tmp_path, lambda t: None), "--deep")
    assert res.exit_code == 0 and codes(doc) <= {"M113", "T104"}, doc["findings"]  # not H3


def test_padding_scales_must_be_zero(tmp_path):
    def mutate(t):
        s = t["lin.weight_scale"].view(torch.uint8).clone()
        s[-1, -1] = 0x38  # inside the padding of a 100-row weight's 128-row tile
        t["lin.weight_scale"] = s.view(torch.float8_e4m3fn)
    p = _one_layer(tmp_path, mutate, n=100, k=512)
    res, doc = validate(p, "--deep")
    assert "D121" in codes(doc), doc["findings"]


@pytest.mark.skipif(not os.environ.get("H3QUANT_SLOW"), reason="full dims: set H3QUANT_SLOW=1")
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(5376, 5376), (21504, 5376), (5376, 14336)])
def test_full_dims_bytes(shape):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    ref = kitchen_quantize(w, LAYOUT)
    out = encode_nvfp4(w)
    for s in ref:
        assert torch.equal(out[s].reshape(-1).view(torch.uint8), ref[s].reshape(-1).view(torch.uint8)), s


def test_row_chunks_decode_with_their_tiles_scales():
    from h3quant.formats.nvfp4 import CODEC

    out = encode_nvfp4(_weight(512, 256, seed=12))
    whole = {"weight_scale": out["weight_scale"], "weight_scale_2": out["weight_scale_2"]}
    full = CODEC.decoder.decode_rows({"weight": out["weight"]}, whole, {})
    views = CODEC.decoder.row_views(whole, {})
    for r0, r1 in ((0, 128), (130, 300), (500, 512)):
        q = out["weight"][r0:r1]
        by_view = CODEC.decoder.decode_rows({"weight": q, "block_grid": views["block_grid"][r0:r1]}, whole, {})
        by_row0 = CODEC.decoder.decode_rows({"weight": q, "_row0": r0}, whole, {})
        assert torch.equal(by_view, full[r0:r1]) and torch.equal(by_row0, full[r0:r1])


def test_convert_refuses_an_unswizzled_source(tmp_path):
    p = _one_layer(tmp_path, _unswizzle)
    out = tmp_path / "o.safetensors"
    res = cli("convert", p, out, "--to", "bf16", "--preset", "all-linears")
    assert res.exit_code == 1 and "D121" in res.output and not out.exists(), res.output
