"""The device records (h3quant.device_kinds): one per kind, asked instead of the kind's name.

The expected facts are written out here from torch's and the vendors' documentation (which
torch.distributed backend serves which device, where ``auto`` looks first), not read from the
records."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from h3quant import device_kinds
from h3quant.errors import DeviceError, TpError

# The house's compute-dtype rule, stated once here as the oracle: float32 on the host (CPU),
# bfloat16 on every accelerator.
EXPECTED = {  # kind: (indexed, torch.distributed backend, activation dtype)
    "cpu": (False, "gloo", torch.float32),
    "cuda": (True, "nccl", torch.bfloat16),
    "mps": (False, None, torch.bfloat16),
    "npu": (True, "hccl", torch.bfloat16),
    "xpu": (True, None, torch.bfloat16),
}


def test_one_record_per_kind_with_the_documented_facts():
    assert set(device_kinds.names()) == set(EXPECTED)
    for name, (indexed, collective, dtype) in EXPECTED.items():
        k = device_kinds.kind(name)
        assert (k.indexed, k.collective, k.compute_dtype) == (indexed, collective, dtype), name
    assert [k.name for k in device_kinds.auto_order()] == ["cuda", "npu", "xpu", "mps"]
    assert device_kinds.HOST.name == "cpu"
    with pytest.raises(DeviceError, match="unknown device kind 'tpu'.*cpu, cuda"):
        device_kinds.kind("tpu")


def test_help_texts_and_the_parser_come_from_the_records():
    from h3quant.runtime.devices import parse_device

    text = device_kinds.device_help()
    assert text == "auto, cpu, cuda[:N], mps, npu[:N] or xpu[:N]"
    for k in device_kinds.KINDS:
        assert parse_device(k.name).kind == k.name
        if k.indexed:
            assert parse_device(f"{k.name}:2").index == 2
        else:
            with pytest.raises(DeviceError, match="takes no index"):
                parse_device(f"{k.name}:0")
    with pytest.raises(DeviceError, match="expected auto, cpu, cuda"):
        parse_device("gpu")
    assert device_kinds.collective_help() == "cpu (gloo), cuda (nccl) or npu (hccl)"


@pytest.mark.parametrize("command", ["verify", "compare", "backends", "capture"])
def test_every_device_option_lists_every_kind(command):
    from helpers.forge import cli

    res = cli(command, "--help")
    assert res.exit_code == 0
    flat = " ".join(res.stdout.split())
    assert device_kinds.device_help(auto=command != "capture") in flat, flat


def test_a_new_kind_is_a_record(monkeypatch):
    """A kind planted as one more record parses, has its dtype and collective, and shows in
    the help text and the tensor-parallel backends: nothing else names it."""
    from h3quant.runtime.devices import Device, parse_device
    from h3quant.runtime.tp.group import backend_for

    tpu = device_kinds.DeviceKind("tpu", "TPU", True, "xla", "float16", "tpu_planted")
    kinds = (*device_kinds.KINDS, tpu)
    monkeypatch.setattr(device_kinds, "KINDS", kinds)
    monkeypatch.setattr(device_kinds, "_BY_NAME", {k.name: k for k in kinds})
    dev = parse_device("tpu:1")
    assert dev == Device("tpu", 1) and dev.compute_dtype is torch.float16
    assert device_kinds.device_help().endswith("xpu[:N] or tpu[:N]")
    assert device_kinds.collectives()["tpu"] == "xla"
    import h3quant.runtime.tp.group as group

    monkeypatch.setattr(group, "BACKENDS", device_kinds.collectives())
    assert backend_for("tpu") == "xla"
    tpu.sync()  # torch has no such module: a no-op, not an error
    assert tpu.device_count() == 0


def test_compute_dtype_on_the_verify_path():
    """The verify and compare pipelines take the activation dtype from the device's record."""
    from h3quant.runtime.devices import Device

    assert Device("cpu").compute_dtype is torch.float32
    assert Device("cuda", 0).compute_dtype is torch.bfloat16
    assert Device("mps").compute_dtype is torch.bfloat16


def test_set_device_needs_the_kinds_package():
    from h3quant.runtime.tp.launch import rank_device

    assert rank_device("cpu", 3) == "cpu"
    npu = device_kinds.kind("npu")
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(TpError, match="device npu needs torch_npu, which is not installed"):
            rank_device("npu", 0)
        with pytest.raises(DeviceError, match="torch_npu"):
            npu.set_device(0)
        npu.sync()  # nothing to wait for: a no-op
    device_kinds.HOST.sync()
    device_kinds.HOST.set_device(0)
    assert device_kinds.HOST.device_count() == 1


def test_tp_error_lives_in_errors_and_keeps_its_old_import():
    from h3quant.runtime.tp.plan import TpError as OldName

    assert OldName is TpError and TpError.__module__ == "h3quant.errors"


def test_records_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        device_kinds.HOST.name = "gpu"  # type: ignore[misc]
