"""Device classes as data: which formats run on a native kernel in ComfyUI, which are dequantized.

A class is what a user names (``ada``, ``apple``, ``ascend``), not a device string: an 8 GB RTX
3070 is ``ampere``, a 4080 ``ada``, a 5090 ``blackwell``. What a format needs lives in its spec
(``FormatSpec.runtime.kitchen``: comfy-kitchen's layout and its ``MIN_SM_VERSION``); this module holds
the devices and the one rule that joins the two, which is ComfyUI's (``comfy/ops.py`` asks the
layout's ``supports_fast_matmul()``: a CUDA capability of at least the layout's minimum, always
true for a layout without one, false without a CUDA device). Sources: docs/FORMATS.md 26.

Torch-free: inspect and validate print from it. It names no format; the callers hand it specs.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.errors import UsageError


@dataclass(frozen=True)
class DeviceClass:
    """One class of device a user may have."""

    name: str  # what ``--device`` names in ``plan`` (and ``backends --profile``)
    label: str  # for people: architecture and example cards
    kind: str  # the device kind it is (h3quant.device_kinds)
    sm: tuple[int, int] | None = None  # the CUDA compute capability (NVIDIA only)

    @property
    def short(self) -> str:
        return self.label.split(" (")[0]


CLASSES: tuple[DeviceClass, ...] = (
    DeviceClass("turing", "NVIDIA Turing (sm_75: RTX 20xx, GTX 16xx, T4)", "cuda", (7, 5)),
    DeviceClass("ampere", "NVIDIA Ampere (sm_80/86: A100, RTX 30xx, A6000)", "cuda", (8, 0)),
    DeviceClass("ada", "NVIDIA Ada (sm_89: RTX 40xx, L4, L40)", "cuda", (8, 9)),
    DeviceClass("hopper", "NVIDIA Hopper (sm_90: H100, H200)", "cuda", (9, 0)),
    DeviceClass("blackwell-dc", "NVIDIA Blackwell data center (sm_100: B200, GB200)", "cuda",
                (10, 0)),
    DeviceClass("blackwell", "NVIDIA Blackwell consumer (sm_120: RTX 50xx, RTX PRO 6000)", "cuda",
                (12, 0)),
    DeviceClass("apple", "Apple MPS (M-series Macs)", "mps"),
    DeviceClass("ascend", "Huawei Ascend (910B and later, torch_npu)", "npu"),
    DeviceClass("cpu", "CPU", "cpu"),
)
_BY_NAME = {c.name: c for c in CLASSES}


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def device_class(name: str) -> DeviceClass:
    """The class named ``name`` (case-insensitive); UsageError naming the classes otherwise."""
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        raise UsageError(f"unknown device class {name!r} (expected one of "
                         f"{', '.join(_BY_NAME)})") from None


def for_capability(sm: tuple[int, int] | None) -> DeviceClass | None:
    """The NVIDIA class of a CUDA capability (sm_86 is ampere, sm_121 blackwell); None if unknown
    or older than Turing."""
    if sm is None:
        return None
    found = None
    for c in CLASSES:
        if c.sm is not None and tuple(sm) >= c.sm:
            found = c
    return found


def for_kind(kind: str, sm: tuple[int, int] | None = None) -> DeviceClass | None:
    """The class of a device kind (with its capability, for CUDA); None when it is not known."""
    if sm is not None:
        return for_capability(sm)
    return next((c for c in CLASSES if c.kind == kind and c.sm is None), None)


def for_device(kind: str, capability) -> DeviceClass | None:
    """The class of a device of ``kind``; ``capability()`` (called only for a kind whose classes
    go by compute capability) gives its capability or None (then the class is unknown)."""
    if any(c.kind == kind and c.sm is not None for c in CLASSES):
        return for_capability(capability())
    return for_kind(kind)


def _kitchen(spec):
    """The format's ``KitchenFacts`` (None: ComfyUI does not load it, or no format)."""
    return spec.runtime.kitchen if spec is not None else None


def native(spec, cls: DeviceClass) -> bool:
    """Whether ComfyUI runs layers of ``spec`` on a kernel on ``cls`` (the layout's rule)."""
    kit = _kitchen(spec)
    if kit is None:
        return False
    if kit.min_sm is None:
        return True
    return cls.sm is not None and cls.sm >= kit.min_sm


def _note(spec, cls: DeviceClass) -> tuple[str, str] | None:
    kit = _kitchen(spec)
    for where, kind, text in (kit.notes if kit is not None else ()):
        at = _BY_NAME.get(where)
        if at is None:
            continue
        if at is cls or (at.sm is not None and cls.sm is not None and cls.sm >= at.sm):
            return kind, text
    return None


def note(spec, cls: DeviceClass) -> str | None:
    """A format's note for a class: one named for it, or for an older NVIDIA class (a note on
    ``hopper`` holds for Blackwell too)."""
    found = _note(spec, cls)
    return found[1] if found else None


def cell(spec, cls: DeviceClass) -> str:
    """One table cell: ``native``, ``dequant``, ``emulated``, ``unverified`` or ``refused``."""
    if _kitchen(spec) is None:
        return "refused"
    if native(spec, cls):
        return "native"
    found = _note(spec, cls)
    return found[0] if found and found[0] else "dequant"


def native_classes(spec) -> list[DeviceClass]:
    return [c for c in CLASSES if native(spec, c)]


def _span(classes: list[DeviceClass]) -> str:
    """``NVIDIA sm_75+ (Turing to Blackwell)``, or the classes' short names."""
    nvidia = [c for c in classes if c.sm is not None]
    every_nvidia = [c for c in CLASSES if c.sm is not None]
    others = [c.short for c in classes if c.sm is None]
    parts = []
    if nvidia and nvidia == every_nvidia[len(every_nvidia) - len(nvidia):]:
        first, last = nvidia[0], nvidia[-1]
        name = first.short.replace("NVIDIA ", "")
        span = name if first is last else f"{name} and newer"
        parts.append(f"NVIDIA sm_{first.sm[0]}{first.sm[1]}+ ({span})")  # type: ignore[index]
    elif nvidia:
        parts.append(", ".join(c.short for c in nvidia))
    if len(others) == len([c for c in CLASSES if c.sm is None]):
        return "every device (no architecture floor)"
    return ", ".join(parts + others)


def load_line(spec) -> str:
    """Will it load, and where does it run fast: one line for ``spec`` (inspect, validate,
    convert)."""
    kit = _kitchen(spec)
    if kit is None:
        return spec.runtime.load_note or "ComfyUI does not load this format"
    fast = native_classes(spec)
    where = _span(fast) if fast else "no device"
    tail = "" if kit.min_sm is None else "; elsewhere dequantized: slower, more memory"
    comfy = f", {kit.comfyui}" if kit.comfyui else ""
    return f"loads with comfy-kitchen >= {kit.since}{comfy}; native kernel on {where}{tail}"
