"""INT4 ConvRot's ``linear_dtype``: what ComfyUI's comfy-kitchen computes for a layer marked
``int8`` (int8 activations on its GPU kernels, int4 on the CPU's eager path, which ignores the
field), checked against kitchen's own functions, and the runtime's emulation of each route."""

import pytest
import torch

from h3quant.calibration.aware import input_rounding
from h3quant.formats.int4_convrot.codec import CODEC
from h3quant.runtime.paths import kernel_layer, layer_path, runtime_layer

pytest.importorskip("comfy_kitchen")

A8 = {"format": "convrot_w4a4", "convrot_groupsize": 256, "linear_dtype": "int8"}
A4 = {"format": "convrot_w4a4", "convrot_groupsize": 256}


def _layer(n=80, k=512, seed=2):
    from comfy_kitchen.backends.eager.convrot_w4a4 import quantize_convrot_w4a4_weight

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 7] *= 12  # an outlier input channel, as real layers have
    q, s = quantize_convrot_w4a4_weight(w, 256)
    x = torch.randn(37, k, generator=g)
    x[:, 7] *= 20
    return {"weight": q, "weight_scale": s}, x, torch.randn(n, generator=g)


def _kitchen_int8_route(x, t, bias):
    """kitchen's GPU int8-activation route written with its eager pieces (what its HIP backend
    does for linear_dtype int8): the int4 codes unpacked to int8 values, then its int8 linear with
    the online ConvRot rotation and per-token int8 activations."""
    from comfy_kitchen.backends.eager.convrot_w4a4 import prepare_int4_weight_for_int8_linear
    from comfy_kitchen.backends.eager.quantization import int8_linear

    w8 = prepare_int4_weight_for_int8_linear(t["weight"])
    return int8_linear(x, w8, t["weight_scale"], bias, torch.float32, convrot=True,
                       convrot_groupsize=256)


@pytest.mark.parametrize("cap", [(8, 9), (8, 0), (9, 0), (12, 0)])
def test_a8_layer_on_a_gpu_is_kitchens_int8_route(cap):
    t, x, b = _layer()
    got = kernel_layer(t, A8, capability=cap, bias=b, compute_dtype=torch.float32)(x)
    want = _kitchen_int8_route(x, t, b)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-5)
    assert "int8 per token" in layer_path(got_mod := kernel_layer(t, A8, capability=cap)).activations
    assert got_mod.backend_name == "emulated"


def test_a4_layer_routes_by_the_gpu():
    """linear_dtype int4: the int4 MMA on sm_8x (kitchen's eager arithmetic), the int8 route on
    Hopper and newer (the marker does not matter there)."""
    from comfy_kitchen.backends.eager.convrot_w4a4 import convrot_w4a4_linear

    t, x, b = _layer(seed=4)
    a4 = convrot_w4a4_linear(x, t["weight"], t["weight_scale"], b, 256)
    ampere = kernel_layer(t, A4, capability=(8, 6), bias=b, compute_dtype=torch.float32)(x)
    assert torch.equal(ampere, a4)
    hopper = kernel_layer(t, A4, capability=(9, 0), bias=b, compute_dtype=torch.float32)(x)
    torch.testing.assert_close(hopper, _kitchen_int8_route(x, t, b), rtol=2e-6, atol=2e-5)
    assert not torch.allclose(hopper, a4, rtol=1e-3, atol=1e-3)


def test_the_cpu_path_ignores_linear_dtype_as_kitchens_eager_does():
    from comfy_kitchen.backends.eager.convrot_w4a4 import convrot_w4a4_linear

    t, x, b = _layer(seed=5)
    want = convrot_w4a4_linear(x, t["weight"], t["weight_scale"], b, 256, linear_dtype="int8")
    mod = runtime_layer(t, A8, bias=b, compute_dtype=torch.float32)
    assert torch.equal(mod(x), want)
    assert "int4" in layer_path(mod, torch.float32).activations


def test_int8_activations_are_closer_to_float():
    t, x, b = _layer(seed=6)
    from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

    ref = x @ decode_int4_convrot(t["weight"], t["weight_scale"], 256).t() + b
    e8 = (kernel_layer(t, A8, capability=(8, 9), bias=b, compute_dtype=torch.float32)(x) - ref)
    e4 = (kernel_layer(t, A4, capability=(8, 9), bias=b, compute_dtype=torch.float32)(x) - ref)
    assert e8.pow(2).sum() * 50 < e4.pow(2).sum()


def test_aware_rounding_follows_the_route():
    from comfy_kitchen.backends.eager.convrot_w4a4 import _build_hadamard, _rotate_activation
    from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise

    _, x, _ = _layer(seed=7)
    rot, xq = input_rounding(CODEC, A8, (8, 9))(x)
    kr = _rotate_activation(x, _build_hadamard(256), 256)
    q, s = quantize_int8_rowwise(kr)
    torch.testing.assert_close(rot, kr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xq, q.float() * s, rtol=1e-6, atol=1e-6)
    # a linear_dtype int8 layer is modelled as GPUs run it even without a capability (its
    # marker changes nothing on the CPU); an int4 one as the CPU and sm_8x run it
    assert torch.equal(input_rounding(CODEC, A8)(x)[1], xq)
    _, xq4 = input_rounding(CODEC, A4)(x)
    _, xq4b = input_rounding(CODEC, A4, (8, 9))(x)
    assert torch.equal(xq4, xq4b)
    assert (xq4 - rot).pow(2).sum() > 100 * (xq - rot).pow(2).sum()
