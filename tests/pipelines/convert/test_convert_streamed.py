"""The two-pass (streamed) encoders of fp8, fp8-e5m2, mxfp8 and nvfp4: a first pass over the rows
for the layer's amax, then row chunks. Written in many chunks, the bytes are still comfy-kitchen's
eager quantizer's of the whole layer (an independent computation)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.fp8 import kitchen_state
from h3quant.formats import registry
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.synth import synth_checkpoint

pytest.importorskip("comfy_kitchen")

# target -> (comfy-kitchen layout, its quantize keywords)
LAYOUTS = {
    "fp8": ("TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}),
    "fp8-e5m2": ("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("streamed") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=1, seed=11)
    return p


@pytest.mark.parametrize("target", sorted(LAYOUTS))
@pytest.mark.parametrize("workers", [1, 2])
def test_many_chunks_give_kitchens_bytes(src, tmp_path, monkeypatch, target, workers):
    from h3quant.pipelines.convert import compute

    calls = []
    real = compute.encode_streamed
    monkeypatch.setattr(compute, "encode_streamed", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(compute, "CHUNK_ELEMS", 1 << 14)  # 128-row chunks at these widths
    out = tmp_path / "o.safetensors"
    convert(src, out, ConvertOptions(target=target, workers=workers))
    assert len(calls) == 4  # every block linear went through the streamed path
    a, b = load_file(src), load_file(out)
    layout, kw = LAYOUTS[target]
    names = sorted(k[:-len(".weight")] for k in b if k.endswith(".comfy_quant") is False
                   and f"{k[:-len('.weight')]}.comfy_quant" in b and k.endswith(".weight"))
    assert len(names) == 4
    for name in names:
        assert a[name + ".weight"].shape[0] > 128  # several chunks per layer
        want = kitchen_state(a[name + ".weight"], layout, name, **kw)
        for key, t in want.items():
            assert b[key].dtype == t.dtype and b[key].shape == t.shape, key
            assert torch.equal(_bits(b[key]), _bits(t)), key


@pytest.mark.parametrize("target", sorted(LAYOUTS))
def test_chunks_with_a_partial_last_tile_give_kitchens_bytes(target):
    """The codec's two-pass contract at a height that is no multiple of 128 (nvfp4 pads it to
    16): chunks of 128 rows, each output placed at its first row, as convert places them."""
    n, k = 352, 256  # 2 whole tiles + 96 rows
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    w[200] *= 40  # the amax lies in the last chunk
    codec = registry.target_codec(target)
    spec = codec.spec
    assert spec.encoding.streamed and not spec.encoding.chunked
    step = max(spec.encoding.chunk_rows, 128)
    spans = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]
    enc = codec.encoder
    value = enc.layer_value([enc.scan_rows(w[a:b]) for a, b in spans]) if codec.spec.encoding.scans else None
    layout, kw = LAYOUTS[target]
    want = kitchen_state(w, layout, "x", **kw)
    got: dict[str, torch.Tensor] = {}
    for r0, r1 in spans:
        for suffix, t in codec.encoder.encode_rows(w[r0:r1], None, "exact", value).items():
            key = f"x.{suffix}"
            if t.dim() == 0:
                got[key] = t
                continue
            if key not in got:
                got[key] = torch.zeros(want[key].shape, dtype=torch.uint8)
            got[key][r0:r0 + t.shape[0]] = t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(_bits(got[key]), _bits(t)), key


@pytest.mark.parametrize("target", ["fp8", "nvfp4"])
def test_a_quantized_source_streams_its_decoded_rows(src, tmp_path, monkeypatch, target):
    """From an int8 file: both passes read the decoded fp32 rows; the bytes are kitchen's
    quantization of the int8 weight decoded here (codes x row scales)."""
    from h3quant.pipelines.convert import compute

    int8 = tmp_path / "int8.safetensors"
    convert(src, int8, ConvertOptions(target="int8"))
    monkeypatch.setattr(compute, "CHUNK_ELEMS", 1 << 14)
    out = tmp_path / "o.safetensors"
    convert(int8, out, ConvertOptions(target=target, workers=2))
    a, b = load_file(int8), load_file(out)
    layout, kw = LAYOUTS[target]
    names = [k[:-len(".weight_scale")] for k in a if k.endswith(".weight_scale")]
    assert len(names) == 4
    for name in names:
        w = a[name + ".weight"].float() * a[name + ".weight_scale"].float().reshape(-1, 1)
        for key, t in kitchen_state(w, layout, name, **kw).items():
            assert torch.equal(_bits(b[key]), _bits(t)), key
