"""One check that a device string names a device this machine has, shared by the CLI's
``--device`` and the Python API, so both refuse an unavailable device with the same
``DeviceError`` message before any work."""

from __future__ import annotations

from h3quant.errors import DeviceError
from h3quant.runtime.capabilities import Probe, live_probe
from h3quant.runtime.devices import Device, parse_device


def unavailable_reason(spec: str, kind: str) -> str:
    return (f"{spec!r}: no {kind} device is available on this machine (h3quant backends "
            f"--device {kind} says why)")


def require_device(spec: str | Device, *, probe: Probe | None = None) -> Device:
    """The parsed device; ``DeviceError`` when it is malformed or absent from this machine
    (``probe``: the facts about torch and the machine; live by default)."""
    dev = parse_device(spec, probe=probe)
    if dev.kind == "cpu":
        return dev
    probe = probe or live_probe()
    if not probe.device_available(dev.kind):
        raise DeviceError(unavailable_reason(str(spec), dev.kind))
    count = probe.device_count(dev.kind) if dev.index is not None else None
    if count is not None and dev.index is not None and dev.index >= count:
        have = f"{dev.kind}:0 to {dev.kind}:{count - 1}" if count > 1 else f"{dev.kind}:0"
        raise DeviceError(f"device {spec}: this machine has {count} {dev.kind} device(s) "
                          f"({have})")
    return dev
