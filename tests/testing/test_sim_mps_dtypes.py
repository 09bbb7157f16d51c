"""The simulated MPS device refuses float64 like real MPS (which has no float64 at all), so a
runtime path that would create or compute a float64 tensor on MPS fails in CPU-only CI too."""

import pytest
import torch

from h3quant.testing.simdevice import simulated_mps


def test_float64_cannot_be_created_or_moved_onto_mps():
    with simulated_mps() as sim:
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(3, dtype=torch.float64, device="mps")
        with pytest.raises(TypeError, match="float64"):
            torch.ones(2, dtype=torch.float64).to("mps")
        x = torch.ones(2, 2).to("mps")  # float32 is fine
        assert x.device.type == "mps" and x.dtype == torch.float32
        with pytest.raises(TypeError, match="float64"):
            x.double()
        with pytest.raises(TypeError, match="float64"):
            x.to(torch.float64)
        with pytest.raises(TypeError, match="float64"):
            x.sum(dtype=torch.float64)
        assert sim.device.fetch(x + 1).tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_float64_on_the_cpu_is_untouched_by_the_mps_simulation():
    with simulated_mps():
        y = torch.ones(2, dtype=torch.float64) * 2  # a CPU tensor: nothing to refuse
        assert y.dtype == torch.float64 and y.device.type == "cpu"
        x = torch.ones(2).to("mps")
        assert x.to("cpu").double().dtype == torch.float64  # back on the CPU, float64 is fine


def test_the_quantized_linear_runs_on_simulated_mps_without_float64():
    """The MPS runtime path (weight dequantized on the device, float matmul) uses no float64."""
    from h3quant.formats.int8.tensors import encode_int8
    from h3quant.runtime.linear import QuantizedLinear

    torch.manual_seed(0)
    w = torch.randn(64, 256)
    q, s = encode_int8(w, convrot=True, group_size=256, per_row=True)
    x = torch.randn(8, 256)
    with simulated_mps() as sim:
        layer = QuantizedLinear.from_int8(q, s, convrot=True, group_size=256, device="mps",
                                          probe=sim.probe)
        y = layer(x.to("mps"))
        assert y.device.type == "mps"
        y_cpu = sim.device.fetch(y)
    rel = ((y_cpu - x @ w.t()).norm() / (x @ w.t()).norm()).item()
    assert rel < 0.02
