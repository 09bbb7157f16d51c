"""Options of ``convert``: targets, layer selection, the per-layer marker each target writes."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace

from h3quant.convrot import is_valid_group_size
from h3quant.errors import ConvertError
from h3quant.formats import registry
from h3quant.h3 import layouts
from h3quant.formats.container.dtypes import FLOAT_DTYPES
from h3quant.patterns import compile_pattern

TARGETS = registry.targets()  # --to name -> Target (the codec that writes it)
PRESETS = ("h3", "all-linears")
MAX_GROUP_SIZE = 1024  # the rotation is g x g: larger groups would only cost memory
REPORT_ROWS = 256  # rows sampled per layer for the error report
REPORT_TOKENS = 64  # tokens of the seeded random activation
REPORT_SEED = 0


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """``FILE[:STRENGTH]`` -> (path, strength); strength defaults to 1.0 and may be negative."""
    path, sep, tail = spec.rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return spec, 1.0


# int8 ConvRot rotation: "exact" reproduces comfy-kitchen's fp32 summation order (bit-identical
# codes); "fast" is ``convrot.rotate`` (on the CPU two small matmuls per block with 16-point
# factors, elsewhere 4-point butterfly passes): equal to fp32 rounding, a few codes per million
# differ by 1 from kitchen's, about 1.3x faster to encode on this project's 2-core machine.
ROTATIONS = ("exact", "fast")
# Weight layouts of the int8 targets: canonical [N, K], or npu = int8_tensorwise_kn [K, N].
LAYOUTS = ("canonical", "npu")


@dataclass(frozen=True)
class ConvertOptions:
    """What ``convert`` does. ``preset=None`` picks ``h3`` for H3 inputs, else ``all-linears``."""

    target: str = "int8-convrot"
    preset: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    group_size: int = 256
    report: bool = True
    workers: int | None = None  # threads encoding row chunks; None: one per CPU (at most 8)
    mmap: bool = True
    overwrite: bool = False
    rotation: str = "exact"  # int8 ConvRot: "exact" (bit-identical to comfy-kitchen) or "fast"
    layout: str = "canonical"  # int8: "canonical" [N, K] or "npu" (int8_tensorwise_kn, [K, N])
    naming: str = "auto"  # the input's naming: auto (detected), comfy, official or diffusers
    loras: tuple[str, ...] = ()  # LoRA files to bake in, "FILE[:STRENGTH]", in order
    lora_skip_unmatched: bool = False  # LoRA keys that fit no layer: skipped (else an error)
    lora_warn: float = 0.5  # warn when a layer keeps less than this share of its LoRA delta
    lora_promote: str | None = None  # a --to target for every layer a LoRA touches
    layers: tuple = ()  # per-layer rules (convert.recipe.Rule), first match wins
    calibration: str | None = None  # statistics file ('h3quant capture'): calibrated rounding
    calibration_heldout: str | None = None  # statistics of held-out inputs: reported only
    awq_scale: bool = True  # AWQ channel scaling folded into the layer before (convert.folds)
    smooth: str = "off"  # "auto": smoothing searched per layer and folded (convert.smoothing)
    calibrate_on: tuple[str, ...] = ()  # inputs files/folders/globs: one-pass calibration
    feedback: str = "float"  # one pass: block b+1 sees float or quantized block b outputs
    activation_aware: str = "off"  # "auto": feedback models the runtime's input rounding
    device: str = "cpu"  # one pass: where the capture and the feedback run
    memory_budget: int | None = None  # one pass: bytes for the calls' hidden states (None: half
    # the memory available); beyond it they are spilled to the work folder
    linear_dtype: str | None = None  # a rule's linear=: INT4 ConvRot's activation dtype
    _patterns: tuple = field(default=(), compare=False, repr=False)
    _rules: tuple = field(default=(), compare=False, repr=False)  # (compiled, options or None)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConvertError(f"unknown target {self.target!r} (choose from {', '.join(TARGETS)})")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConvertError(f"unknown preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        if not is_valid_group_size(self.group_size) or self.group_size > MAX_GROUP_SIZE:
            raise ConvertError(f"--group-size must be a power of 4 in 4..{MAX_GROUP_SIZE} "
                               "(4, 16, 64, 256, 1024), "
                               f"got {self.group_size!r}")
        if self.rotation not in ROTATIONS:
            raise ConvertError(f"--rotation must be one of {', '.join(ROTATIONS)}, "
                               f"got {self.rotation!r}")
        if self.layout not in LAYOUTS:
            raise ConvertError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        object.__setattr__(self, "calibrate_on", tuple(str(p) for p in self.calibrate_on))
        statistics = bool(self.calibration or self.calibrate_on)
        if self.calibration and self.calibrate_on:
            raise ConvertError("give --calibration (a statistics file) or --calibrate-on "
                               "(inputs, one pass), not both")
        if self.feedback not in ("quantized", "float"):
            raise ConvertError(f"--feedback must be quantized or float, got {self.feedback!r}")
        if self.device != "cpu" and not self.calibrate_on:
            raise ConvertError("--device applies to --calibrate-on (the layers are encoded on "
                               "the CPU)")
        if self.memory_budget is not None and not self.calibrate_on:
            raise ConvertError("--memory-budget applies to --calibrate-on")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConvertError(f"--memory-budget must be more than 0 bytes, got {self.memory_budget}")
        if self.calibrate_on and self.smooth != "off" and self.feedback != "float":
            raise ConvertError("--smooth with --calibrate-on takes --feedback float (the "
                               "quantized feedback does not run smoothed blocks)")
        refusal = registry.target_codec(self.target).spec.encoding.write_refusal
        if refusal and not statistics:  # written from statistics only
            raise ConvertError(f"--to {self.target}: {refusal}")
        if registry.with_layout(registry.target_codec(self.target), self.layout) is None:
            raise ConvertError(f"--layout {self.layout} is not available for --to {self.target} "
                               f"(it has {', '.join(registry.layouts_of(registry.target_codec(self.target)))})")
        if self.naming not in ("auto", *layouts.names()):
            raise ConvertError(f"--naming must be auto, {', '.join(layouts.names()[:-1])} or "
                               f"{layouts.names()[-1]}, got {self.naming!r}")
        object.__setattr__(self, "loras", tuple(self.loras))
        if self.calibration_heldout and not self.calibration:
            raise ConvertError("--calibration-heldout needs --calibration")
        if not self.awq_scale and not statistics:
            raise ConvertError("--no-awq-scale needs --calibration (channel scaling is only "
                               "done from statistics)")
        if self.smooth not in ("auto", "off"):
            raise ConvertError(f"--smooth must be auto or off, got {self.smooth!r}")
        if self.smooth == "auto" and not statistics:
            raise ConvertError("--smooth auto needs --calibration or --calibrate-on (the factors "
                               "are chosen from the statistics)")
        if self.activation_aware not in ("auto", "off"):
            raise ConvertError("--activation-aware must be auto or off, got "
                               f"{self.activation_aware!r}")
        if self.activation_aware == "auto" and not self.calibration:
            raise ConvertError("--activation-aware auto needs --calibration (the rounded "
                               "inputs are modelled from the statistics)")
        if self.lora_promote is not None and self.lora_promote not in TARGETS:
            raise ConvertError(f"--lora-promote must be one of {', '.join(TARGETS)}, "
                               f"got {self.lora_promote!r}")
        if not 0.0 <= self.lora_warn <= 1.0:
            raise ConvertError(f"--lora-warn must be a share in 0..1, got {self.lora_warn!r}")
        if self.workers is None:
            object.__setattr__(self, "workers", max(1, min(os.cpu_count() or 1, 8)))
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ConvertError(f"--workers must be a positive integer, got {self.workers!r}")
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        compiled = []
        for flag, pats in (("--include", self.include), ("--exclude", self.exclude)):
            out = []
            for pat in pats:  # bounded matching time (h3quant.patterns), or a usage error
                out.append(compile_pattern(pat, f"{flag} {pat!r}", ConvertError))
            compiled.append(tuple(out))
        object.__setattr__(self, "_patterns", tuple(compiled))
        self._compile_rules()

    def _compile_rules(self) -> None:
        """Each rule's pattern and the options of the layers it decides (None: keep)."""
        from h3quant.pipelines.convert.recipe import Rule

        object.__setattr__(self, "layers", tuple(self.layers))
        out = []
        for i, rule in enumerate(self.layers, 1):
            if not isinstance(rule, Rule):
                raise ConvertError(f"layer rule {i} must be a recipe Rule, got {rule!r}")
            sub = None
            if rule.target is not None:
                try:
                    sub = replace(self, target=rule.target, layers=(),
                                  group_size=rule.group_size or self.group_size,
                                  linear_dtype=rule.linear_dtype,
                                  layout=rule.layout or ("canonical" if registry.with_layout(
                                      registry.target_codec(rule.target), self.layout) is None
                                      else self.layout))
                except ConvertError as exc:
                    raise ConvertError(f"rule {i} {rule.text!r}: {exc.reason}") from None
            out.append((re.compile(rule.pattern) if rule.internal else
                        compile_pattern(rule.pattern, f"rule {i} {rule.text!r}", ConvertError),
                        sub))
        object.__setattr__(self, "_rules", tuple(out))

    def for_layer(self, layer: str) -> tuple[int | None, "ConvertOptions | None"]:
        """(rule index, options) deciding ``layer``: the first matching rule's options (None
        for ``keep``), or (None, self) when no rule matches."""
        for i, (pat, sub) in enumerate(self._rules):
            if pat.search(layer):
                return i, sub
        return None, self

    @property
    def codec(self) -> registry.Codec:
        """The codec the target writes (in the chosen layout)."""
        codec = registry.with_layout(registry.target_codec(self.target), self.layout)
        assert codec is not None  # __post_init__ refused a layout the target does not have
        return codec

    @property
    def convrot(self) -> bool:
        return TARGETS[self.target].convrot

    def marker(self) -> dict | None:
        """The canonical marker object the target writes (None for a plain float target)."""
        marker = self.codec.spec.planning.marker(TARGETS[self.target], self.group_size)
        if marker is not None and self.linear_dtype is not None:
            marker = self.codec.spec.planning.with_linear_dtype(marker, self.linear_dtype) or marker
        return marker

    def filtered(self, layer: str) -> bool:
        """True when ``--include``/``--exclude`` keep ``layer`` (``re.search`` on the name)."""
        inc, exc = self._patterns
        if inc and not any(p.search(layer) for p in inc):
            return False
        return not any(p.search(layer) for p in exc)

    def provenance(self, preset: str) -> str:
        """The ``h3quant.options`` header value: only what changes the output bytes."""
        body = {"target": self.target, "preset": preset, "include": list(self.include),
                "exclude": list(self.exclude), "group_size": self.group_size}
        if self.rotation != "exact":
            body["rotation"] = self.rotation
        if self.layout != "canonical":
            body["layout"] = self.layout
        if self.loras:  # baked LoRAs change the bytes: file names and strengths

            body["lora"] = [[os.path.basename(p), s] for p, s in map(parse_lora_spec, self.loras)]
        if self.layers:
            body["layers"] = [r.text for r in self.layers]
        if self.calibration:  # calibrated codes: the statistics file's name
            body["calibration"] = os.path.basename(self.calibration)
        if self.smooth != "off":
            body["smooth"] = self.smooth
        if self.calibrate_on:  # calibrated in one pass: how the blocks fed each other
            body["calibrate_on"] = {"feedback": self.feedback}
        return json.dumps(body, sort_keys=True)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_patterns", None)
        d.pop("_rules", None)
        d["include"], d["exclude"] = list(self.include), list(self.exclude)
        d["loras"] = list(self.loras)
        d["layers"] = [r.text for r in self.layers]
        d["calibrate_on"] = list(self.calibrate_on)
        return d


def is_h3(tensors: dict) -> bool:
    from h3quant.errors import H3QuantError
    from h3quant.h3.topology import detect

    try:
        return detect(tensors) is not None
    except H3QuantError:
        return False


def wide_rules(options: "ConvertOptions", preset: str, weights: dict[str, tuple[int, ...]]
               ) -> frozenset[int]:
    """The rules (indices) that name no layer the preset picks: those apply to any linear of
    the input (``--layer 'token_refiner\\.=bf16'``); every other rule keeps to the preset's
    layers. ``weights``: layer name -> weight shape."""
    picked = [n for n, shape in weights.items() if options.filtered(n)
              and preset_selects(preset, n, "F32", len(shape), True)]
    return frozenset(i for i, (pat, _) in enumerate(options._rules)
                     if not any(pat.search(n) for n in picked))


def preset_selects(preset: str, layer: str, weight_dtype: str, weight_rank: int,
                   quantized: bool) -> bool:
    """Whether ``preset`` picks ``layer`` (before ``--include``/``--exclude``)."""
    if preset == "h3":
        from h3quant.h3.topology import is_h3_block_linear

        return is_h3_block_linear(layer)
    # all-linears: every 2-D float weight, and every already-quantized linear
    return weight_rank == 2 and (weight_dtype in FLOAT_DTYPES or quantized)
