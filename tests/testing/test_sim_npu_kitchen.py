"""comfy-kitchen's OWN Ascend backend run against the SIMULATED torch_npu, compared with h3quant's
npu backend on the same file: the simulation is checked against a real caller, not only
against h3quant. Plus the simulated ``npu_rotate_quant`` against an oracle written here, and its
documented limits."""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest
import torch

from helpers.h3files import quantize_file

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.runtime.linear import QuantizedLinear
from h3quant.testing.sim_npu import simulated_npu

pytest.importorskip("comfy_kitchen")

GROUP = 256
LAYERS = ("blocks.0.attn.qkv_proj", "blocks.0.mlp.fc1", "blocks.1.mlp.fc2")


@contextlib.contextmanager
def kitchen_ascend():
    """Import comfy-kitchen's Ascend backend afresh under the active simulation (it probes
    torch_npu at import); its registry entry and module are restored afterwards."""
    from comfy_kitchen.registry import registry

    names = [m for m in sys.modules if m.startswith("comfy_kitchen.backends.ascend")]
    saved_mods = {m: sys.modules.pop(m) for m in names}
    saved_reg = {k: dict(getattr(registry, k)) for k in
                 ("_backends", "_capabilities", "_constraints", "_unavailable")}
    try:
        mod = importlib.import_module("comfy_kitchen.backends.ascend")
        yield mod
    finally:
        for m in [m for m in sys.modules if m.startswith("comfy_kitchen.backends.ascend")]:
            sys.modules.pop(m)
        sys.modules.update(saved_mods)
        for k, v in saved_reg.items():
            getattr(registry, k).clear()
            getattr(registry, k).update(v)


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory):
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("npuk")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=5)
    path = quantize_file(src, d / "int8.safetensors")
    with Checkpoint(path) as ck:
        return {name: (ck.read(name + ".weight").clone(), ck.read(name + ".weight_scale").clone())
                for name in LAYERS}


def _x(k, rows=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 7] *= 25  # an outlier channel: the rotation matters
    x[3] = 0  # an all-zero token
    return x.to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_kitchen_ascend_backend_equals_h3quant_npu_backend(int8_file, fused):
    with simulated_npu(rotate_quant=fused) as sim, kitchen_ascend() as ck:
        assert ck._ASCEND_DEVICE_AVAILABLE
        assert ck._ASCEND_ROTATE_QUANT_AVAILABLE is fused
        npu = sim.extras["module"]
        for name, (q, s) in int8_file.items():
            x = _x(q.shape[1], seed=len(name))
            ours = QuantizedLinear.from_int8(q, s, convrot=True, group_size=GROUP,
                                             device="npu", probe=sim.probe)
            assert ours.backend_name == "npu"
            npu.calls.clear()
            y_ours = sim.device.fetch(ours(sim.device.put(x)))
            calls_ours = list(npu.calls)
            npu.calls.clear()
            y_kit = sim.device.fetch(ck.int8_linear(
                sim.device.put(x), sim.device.put(q), sim.device.put(s),
                out_dtype=torch.bfloat16, convrot=True, convrot_groupsize=GROUP))
            calls_kit = list(npu.calls)
            quant = "npu_rotate_quant" if fused else "npu_dynamic_quant"
            assert calls_ours == calls_kit == [quant, "npu_quant_matmul"], (calls_ours, calls_kit)
            assert y_ours.dtype == y_kit.dtype == torch.bfloat16
            assert torch.equal(y_ours, y_kit), name
            # and both are the layer's math: close to the float product of the same weights
            from h3quant.convrot import hadamard
            h = hadamard(GROUP).double()
            w = (q.double() * s.double().reshape(-1, 1)).reshape(q.shape[0], -1, GROUP) @ h
            ref = x.double() @ w.reshape(q.shape).t()
            err = ((y_ours.double() - ref).norm() / ref.norm()).item()
            assert err < 0.03, (name, err)


def test_fused_and_unfused_differ_only_by_the_bf16_rounding_of_the_rotation(int8_file):
    q, s = int8_file["blocks.0.mlp.fc1"]
    x = _x(q.shape[1], seed=9)
    outs = []
    for fused in (True, False):
        with simulated_npu(rotate_quant=fused) as sim:
            lin = QuantizedLinear.from_int8(q, s, convrot=True, group_size=GROUP, device="npu",
                                            probe=sim.probe)
            outs.append(sim.device.fetch(lin(sim.device.put(x))).double())
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert 0 < rel < 0.02, rel  # a few codes move by one; the output rounds to bf16


def _oracle_rotate_quant(x, h):
    """Test-side oracle: fp64 block rotation, per-row absmax / 127, round half to even."""
    m, k = x.shape
    g = h.shape[0]
    r = (x.double().reshape(m, k // g, g) @ h.double()).reshape(m, k)
    scale = r.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(r / safe[:, None]).clamp(-128, 127).to(torch.int8), scale


@pytest.mark.parametrize("g", [16, 64, 1024])
def test_simulated_rotate_quant_against_an_oracle_and_through_kitchen(g):
    from h3quant.convrot import hadamard

    x = _x(2048, rows=9, seed=g)
    h = hadamard(g).to(torch.bfloat16)
    want_q, want_s = _oracle_rotate_quant(x, h)
    with simulated_npu() as sim, kitchen_ascend() as ck:
        npu = sim.extras["module"]
        q, sc = npu.npu_rotate_quant(sim.device.put(x), sim.device.put(h), dst_dtype=1,
                                     axis=-1, round_mode="rint", scale_alg=0,
                                     dst_type_max=0.0, transpose_y=False)
        q, sc = sim.device.fetch(q), sim.device.fetch(sc)
        # kitchen's own fused quantizer entry point, on the same op
        kq, ks = ck.quantize_and_rotate_rowwise(sim.device.put(x), sim.device.put(h), g)
        kq, ks = sim.device.fetch(kq), sim.device.fetch(ks)
    assert q.dtype == torch.int8 and sc.dtype == torch.float32 and sc.shape == (9,)
    assert torch.allclose(sc.double(), want_s, rtol=1e-6, atol=0)
    assert (q.int() - want_q.int()).abs().max() <= 1  # fp32 vs fp64 at rounding ties
    assert (q != want_q).float().mean() < 1e-3
    assert torch.equal(kq, q) and torch.equal(ks.reshape(-1)[sc > 0], sc[sc > 0])


def test_simulated_rotate_quant_enforces_the_documented_limits():
    from h3quant.convrot import hadamard

    with simulated_npu() as sim:
        npu, put = sim.extras["module"], sim.device.put
        x = put(_x(512, rows=4))
        h = put(hadamard(16).to(torch.bfloat16))
        for bad_x, bad_h, msg in (
                (x, put(hadamard(4).to(torch.bfloat16)), "rotation size 4"),
                (put(_x(4096, rows=5)), put(hadamard(4096).to(torch.bfloat16)),
                 "rotation size 4096"),
                (put(_x(60, rows=5)), put(torch.eye(20, dtype=torch.bfloat16)),
                 "not a multiple of 8"),
                (put(_x(48, rows=5)), put(torch.eye(32, dtype=torch.bfloat16)), "does not divide"),
                (put(_x(512, rows=4).float()), put(hadamard(16)), "float16 or bfloat16"),
                (x, put(hadamard(16).to(torch.float16)), "x's dtype"),
                (x, hadamard(16).to(torch.bfloat16), "must be a tensor on npu")):
            with pytest.raises(RuntimeError, match=msg):
                npu.npu_rotate_quant(bad_x, bad_h)
        with pytest.raises(NotImplementedError):
            npu.npu_rotate_quant(x, h, dst_dtype=29)
    with simulated_npu(rotate_quant=False) as sim:
        assert not hasattr(sim.extras["module"], "npu_rotate_quant")
