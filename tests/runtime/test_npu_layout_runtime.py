"""Running int8_tensorwise_kn files (FORMATS.md 9 and 6): the loader keeps [K, N] as stored, the
SIMULATED NPU takes it as is (FRACTAL_NZ cast at load when aligned, no transpose or contiguous
copy, the ND tensor released), other devices use the .t() view, verify passes everywhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.runtime import quantize_weight

from h3quant.formats.container.reader import SafetensorsFile
from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.blocks import verify_checkpoint
from h3quant.runtime.model.block import quantized_linear
from h3quant.runtime.linear import QuantizedLinear
from h3quant.runtime.loader import load_blocks
from h3quant.synth import synth_checkpoint
from h3quant.testing.sim_npu import simulated_npu
from h3quant.testing.simdevice import simulated_mps, unwrap

if importlib.util.find_spec("torch_npu") is not None:  # pragma: no cover
    pytest.skip("a real torch_npu is installed; the simulation would shadow it",
                allow_module_level=True)

LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
TOKENS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("knrt")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    canon, kn = d / "canon.safetensors", d / "kn.safetensors"
    convert(src, canon, ConvertOptions(report=False))
    convert(src, kn, ConvertOptions(layout="npu", report=False))
    return {"src": src, "canon": canon, "kn": kn}


def test_loader_keeps_the_stored_kn_weight_and_views_its_transpose(files):
    (kb,) = load_blocks(files["kn"], [0])
    (cb,) = load_blocks(files["canon"], [0])
    for name in LINEARS:
        k, c = kb.linear(name), cb.linear(name)
        assert k.format.value == "int8_tensorwise_kn" and k.is_int8
        assert (k.out_features, k.in_features) == (c.out_features, c.in_features)
        assert tuple(k.weight.shape) == (c.in_features, c.out_features)
        q, s = k.int8_grid()
        assert q.data_ptr() == k.weight.data_ptr() and not q.is_contiguous()  # a view, no copy
        assert torch.equal(q, c.int8_grid()[0]) and torch.equal(s, c.int8_grid()[1])
        assert torch.equal(k.dequantize(), c.dequantize())


def _npu_linears(path, sim, mmap=True):
    (block,) = load_blocks(path, [0], mmap=mmap)
    start = len(sim.device.events)
    mods = {n: quantized_linear(block.linear(n), device="npu", probe=sim.probe) for n in LINEARS}
    return block, mods, sim.device.events[start:]


def test_npu_load_of_a_kn_file_copies_nothing_and_casts_to_nz(files):
    x = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    with simulated_npu() as sim:
        module = sim.extras["module"]
        nd_buffers = []
        real_cast = module.npu_format_cast

        def spy(t, fmt):
            nd_buffers.append(unwrap(t).data_ptr())
            return real_cast(t, fmt)

        module.npu_format_cast = spy
        block, mods, events = _npu_linears(files["kn"], sim)
        moved = [e for e in events if e.kind == "to_device"]
        weights = {block.linear(n).weight.numel() for n in LINEARS}
        # each weight crosses to the device exactly once, as the stored [K, N] bytes ...
        assert sorted(e.nbytes for e in moved if e.nbytes in weights) == sorted(
            block.linear(n).weight.numel() for n in LINEARS)
        # ... and is never copied on the device (no transpose, no .contiguous())
        assert [e for e in events if e.kind == "copy"] == []
        casts = [e for e in events if e.kind == "format_cast"]
        assert len(casts) == 4 and module.calls.count("npu_format_cast") == 4
        assert len(nd_buffers) == len(mods)  # one cast per layer, in build order
        for (name, mod), nd in zip(mods.items(), nd_buffers):
            assert mod.backend_name == "npu" and mod.runner.weight_format == "FRACTAL_NZ"
            assert module.get_npu_format(mod.runner.w_t) == 29
            # the layer keeps one device weight, the NZ one: the ND tensor is released
            held = {unwrap(t).data_ptr() for t in (mod.weight, mod._weights.q, mod.runner.w.q,
                                                   mod.runner.fallback.w.q)}
            assert held == {unwrap(mod.runner.w_t).data_ptr()} and nd not in held
        y = {n: sim.device.fetch(mods[n](sim.device.put(x))) for n in ("attn.qkv_proj",
                                                                         "attn.out_proj")}
    with simulated_npu() as sim:  # the canonical file: .t() view, ND, the same numbers
        _, cmods, cevents = _npu_linears(files["canon"], sim)
        assert [e for e in cevents if e.kind in ("copy", "format_cast")] == []
        assert {m.runner.weight_format for m in cmods.values()} == {"ND (transposed view)"}
        for n, yk in y.items():
            assert torch.equal(yk, sim.device.fetch(cmods[n](sim.device.put(x))))


def test_no_mmap_npu_load_reads_each_weight_once_into_one_buffer(files, monkeypatch):
    reads = []
    real = SafetensorsFile.read_bytes

    def counting(self, info, start=0, length=None):
        data = real(self, info, start, length)
        reads.append((info.name, id(data), len(data)))
        return data

    monkeypatch.setattr(SafetensorsFile, "read_bytes", counting)
    with simulated_npu() as sim:
        block, _, events = _npu_linears(files["kn"], sim, mmap=False)
        for name in LINEARS:
            w = block.linear(name).weight
            mine = [r for r in reads if r[0] == f"blocks.0.{name}.weight"]
            assert len(mine) == 1 and mine[0][2] == w.numel()  # one read, one host buffer
            assert sum(e.nbytes == w.numel() for e in events if e.kind == "to_device") >= 1
        big = min(block.linear(n).weight.numel() for n in LINEARS)
        moves = [e for e in events if e.kind == "to_device" and e.nbytes >= big]
        assert len(moves) == 4  # moved once each
        assert [e for e in events if e.kind == "copy"] == []


def test_unaligned_kn_weight_stays_nd_and_matches_canonical():
    g = torch.Generator().manual_seed(2)
    q, s = quantize_weight(torch.randn(48, 256, generator=g))  # N=48: N % 32 != 0
    kn = q.t().contiguous()
    x = torch.randn(4, 256, generator=g, dtype=torch.bfloat16)
    with simulated_npu() as sim:
        a = QuantizedLinear.from_int8(kn.t(), s.reshape(-1), convrot=True, device="npu",
                                      probe=sim.probe)
        b = QuantizedLinear.from_int8(q, s, convrot=True, device="npu", probe=sim.probe)
        assert a.runner.weight_format == "ND" and b.runner.weight_format == "ND (transposed view)"
        assert "npu_format_cast" not in sim.extras["module"].calls
        assert a.runner.w_t.is_contiguous() and tuple(a.runner.w_t.shape) == (256, 48)
        xs = sim.device.put(x)
        assert torch.equal(sim.device.fetch(a(xs)), sim.device.fetch(b(xs)))


def test_simulated_format_cast_rules():
    with simulated_npu() as sim:
        m = sim.extras["module"]
        w = sim.device.put(torch.zeros(32, 64, dtype=torch.int8))
        nz = m.npu_format_cast(w, 29)
        assert m.get_npu_format(nz) == 29 and m.get_npu_format(w) == 2
        assert m.npu_format_cast(nz, 29) is nz
        with pytest.raises(RuntimeError, match="not aligned"):
            m.npu_format_cast(sim.device.put(torch.zeros(32, 48, dtype=torch.int8)), 29)
        with pytest.raises(RuntimeError, match="must be a tensor on npu"):
            m.npu_format_cast(torch.zeros(32, 64, dtype=torch.int8), 29)
        before = len(sim.device.copies())
        m.npu_format_cast(sim.device.put(torch.zeros(64, 32, dtype=torch.int8)).t(), 29)
        kinds = [e.kind for e in sim.device.copies()[before:]]
        assert kinds == ["copy", "format_cast"]  # a strided input is made contiguous first


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "npu", "mps"])
def test_verify_passes_on_kn_files_on_every_device(files, device):
    if device == "cpu":
        r = verify_checkpoint(files["kn"], reference=files["src"], device="cpu", tokens=TOKENS)
    else:
        sim_ctx = simulated_npu() if device == "npu" else simulated_mps()
        with sim_ctx as sim:
            r = verify_checkpoint(files["kn"], reference=files["src"], device=device,
                                  tokens=TOKENS, probe=sim.probe)
            assert not sim.device.saw("aten::_int_mm")
    assert r.passed, r.failures
    assert {c.format for c in r.layers} == {"int8_tensorwise_kn"}
    want = {"cpu": "torch-int8", "npu": "npu", "mps": "dequant"}[device]
    assert {c.backend for c in r.layers} == {want}
    if device == "cpu":  # the same codes: the same numbers as the canonical file
        c = verify_checkpoint(files["canon"], reference=files["src"], device="cpu", tokens=TOKENS)
        assert [x.rel_err for x in r.layers] == [x.rel_err for x in c.layers]


# ------------------------------------------------------------------------- verify --model


@pytest.mark.slow
def test_whole_model_on_a_kn_file_equals_the_canonical_file(files):
    """The streamed H3 forward (verify --model) loads kn blocks as they are: on the CPU and on the
    simulated NPU it computes exactly what it computes from the canonical file."""
    from click.testing import CliRunner

    from h3quant.cli import main
    from h3quant.pipelines.verify.model import ModelInputs, verify_model

    small = ModelInputs(frames=1, height=4, width=4, audio_frames=4, text_tokens=6)
    kn = verify_model(files["kn"], reference=files["src"], device="cpu", inputs=small)
    canon = verify_model(files["canon"], reference=files["src"], device="cpu", inputs=small)
    assert kn.passed, kn.failures
    assert [o.sqnr_db for o in kn.outputs] == [o.sqnr_db for o in canon.outputs]
    with simulated_npu() as sim:
        npu = verify_model(files["kn"], reference=files["src"], device="npu", inputs=small,
                           probe=sim.probe)
        assert "npu_format_cast" in sim.extras["module"].calls
        assert not sim.device.of_kind("cpu_fallback")
    assert npu.passed, npu.failures
    with simulated_npu() as sim:
        npu_c = verify_model(files["canon"], reference=files["src"], device="npu", inputs=small,
                             probe=sim.probe)
    assert [o.sqnr_db for o in npu.outputs] == [o.sqnr_db for o in npu_c.outputs]
    res = CliRunner().invoke(main, ["verify", str(files["kn"]), "--model", "--frames", "1",
                                    "--height", "4", "--width", "4", "--audio-frames", "4",
                                    "--text-tokens", "6"])
    assert res.exit_code == 0, res.output


def test_cuda_sends_kn_weights_to_torch_int8_not_to_kitchen():
    """comfy-kitchen's CUDA kernels read a row-major [N, K]: a kn weight's view goes to
    torch._int_mm (which takes the strides) instead, with the reason recorded."""
    ck = pytest.importorskip("comfy_kitchen")
    from h3quant.runtime.backends import select_backend
    from h3quant.runtime.backends.base import Int8Weights
    from h3quant.runtime.capabilities import INT_MM_OP, StaticProbe
    from h3quant.runtime.devices import Device

    q, s = quantize_weight(torch.randn(64, 256, generator=torch.Generator().manual_seed(3)))
    probe = StaticProbe(cuda=True, cuda_cc=(8, 9), kitchen=ck,
                        kernels=frozenset({(INT_MM_OP, "CUDA"), (INT_MM_OP, "CPU")}))
    canon = Int8Weights(q, s, s.reshape(-1), None, True, 256)
    kn = Int8Weights(q.t().contiguous().t(), s.reshape(-1), s.reshape(-1), None, True, 256)
    assert select_backend(canon, Device("cuda"), probe).backend.name == "kitchen"
    sel = select_backend(kn, Device("cuda"), probe)
    assert sel.backend.name == "torch-int8" and "pre-transposed" in sel.rejected["kitchen"][0]
