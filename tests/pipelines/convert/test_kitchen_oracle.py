"""End to end against comfy-kitchen: every converted layer of a synthetic H3 file, bit for bit."""

import pytest
import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.formats.markers import marker_bytes
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.synth import synth_checkpoint

ck_tensor = pytest.importorskip("comfy_kitchen.tensor")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=3)
    out = d / "int8.safetensors"
    convert(src, out, ConvertOptions(target="int8-convrot"))
    return src, out


@pytest.mark.slow
def test_every_block_linear_equals_kitchen(files):
    src, out = files
    with Checkpoint(src) as a, Checkpoint(out) as b:
        scan = scan_checkpoint(b)
        assert not scan.findings
        names = sorted(scan.quantized)
        assert len(names) == 8  # 4 linears x 2 blocks, nothing else
        for name in names:
            ref = ck_tensor.QuantizedTensor.from_float(
                a.read(name + ".weight").float(), "TensorWiseINT8Layout",
                per_channel=True, convrot=True, convrot_groupsize=256)
            q, s = b.read(name + ".weight"), b.read(name + ".weight_scale")
            assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (q.shape[0], 1)
            assert torch.equal(ref._qdata, q), name
            assert torch.equal(ref._params.scale.reshape(-1, 1), s), name
            # kitchen's dequantization of our stored tensors is what it made itself
            torch.testing.assert_close(ref.dequantize().float(), ck_tensor.QuantizedTensor(
                q, "TensorWiseINT8Layout", ref._params).dequantize().float(), rtol=0, atol=0)


def test_markers_and_header_agree_canonically(files):
    _, out = files
    with Checkpoint(out) as b:
        scan = scan_checkpoint(b)
        canonical = marker_bytes({"format": "int8_tensorwise", "convrot": True,
                                  "convrot_groupsize": 256})
        assert len(canonical) == 72
        for name, layer in scan.quantized.items():
            assert layer.source == "header+tensor"
            assert bytes(b.read_bytes(name + ".comfy_quant")) == canonical


@pytest.mark.slow
def test_kitchen_written_w4a8_file_reads_validates_and_verifies(tmp_path):
    """A W4A8 file whose layers comfy-kitchen encoded (state_dict as ComfyUI saves it)."""
    from click.testing import CliRunner

    from h3quant.cli import main
    from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor
    from h3quant.h3.topology import block_linear_names, config_for
    from h3quant.formats.container.writer import save_tensors

    src = tmp_path / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    marker = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}
    with Checkpoint(src) as ck:
        tensors = {n: ck.read(n).clone() for n in ck.tensors}
        meta = dict(ck.metadata)
    for layer in block_linear_names(config_for("tiny", blocks=1)):
        w = tensors.pop(layer + ".weight")
        qt = ck_tensor.QuantizedTensor.from_float(w.float(), "AsymW4A8Int8Layout")
        for key, value in qt.state_dict(layer + ".weight").items():
            tensors[key.replace(".weight.", ".", 1) if key.startswith(layer + ".weight.") else key] = value
        tensors.setdefault(layer + ".comfy_quant", marker_tensor(marker))
    layers = {n: marker for n in block_linear_names(config_for("tiny", blocks=1))}
    meta[HEADER_KEY] = header_metadata_value(layers)
    out = tmp_path / "kitchen_w4a8.safetensors"
    save_tensors(out, tensors, meta)

    runner = CliRunner()
    res = runner.invoke(main, ["validate", str(out), "--deep"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["verify", str(out), "--reference", str(src), "--blocks", "1",
                               "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "asym_w4a8_int8" in res.output and "PASS" in res.output


def test_fast_rotation_is_within_one_code_of_kitchen(files, tmp_path):
    src, exact_out = files
    fast_out = tmp_path / "fast.safetensors"
    convert(src, fast_out, ConvertOptions(target="int8-convrot", rotation="fast"))
    with Checkpoint(exact_out) as a, Checkpoint(fast_out) as b:
        assert "rotation" in b.metadata["h3quant.options"]
        assert "rotation" not in a.metadata["h3quant.options"]
        for name in scan_checkpoint(a).quantized:
            qa, qb = a.read(name + ".weight"), b.read(name + ".weight")
            assert (qa.int() - qb.int()).abs().max() <= 1, name
            torch.testing.assert_close(a.read(name + ".weight_scale"), b.read(name + ".weight_scale"),
                                       rtol=1e-6, atol=0)


def test_unknown_rotation_rejected():
    from h3quant.errors import ConvertError

    with pytest.raises(ConvertError, match="--rotation"):
        ConvertOptions(rotation="sylvester")
