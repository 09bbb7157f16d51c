"""``validate``: every rule of FORMATS.md 1-5 over a checkpoint, as coded findings.

Stages: container (and shards), layer markers, per-layer schemes, H3 topology, and with
``deep=True`` the data checks. A file whose header cannot be parsed stops after the container
stage. An unexpected exception inside a stage becomes an X101 finding, never a traceback;
only a missing or unreadable input raises (``ContainerError``, exit 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from h3quant.errors import ContainerError, H3QuantError, UsageError
from h3quant.findings import Finding, Severity, all_rules
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.check import check_layer
from h3quant.formats.markers import unread_metadata
from h3quant.pipelines.headers import naming as naming_view
from h3quant.pipelines.headers.layer_scan import scan

# Container codes after which nothing in that file can be read.
FATAL_CODES = frozenset({"C101", "C102", "C103", "C112", "S101"})
_KNOWN = {r.code for r in all_rules()}


@dataclass
class ValidateResult:
    path: str
    deep: bool
    findings: list[Finding]
    counts: dict[str, int]
    ok: bool
    checked: dict = field(default_factory=dict)  # what was looked at: tensors, layers, stages
    # will it load, and where does it run fast: one line per quantized format in the file
    loads: dict[str, str] = field(default_factory=dict)
    loader: str | None = None  # the other loader whose rules were applied (validate --loader)

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "ok": self.ok,
            "deep": self.deep,
            "counts": self.counts,
            "checked": self.checked,
            "findings": [f.to_dict() for f in self.findings],
            "loads": self.loads,
            "loader": self.loader,
        }


VALIDATE_KEYS = ("path", "ok", "deep", "counts", "checked", "findings", "loads", "loader")


def _guard(stage: str, where: str, out: list[Finding], fn, *args, tensor: str | None = None):
    """Run one check; an exception becomes a finding instead of escaping."""
    try:
        return fn(*args)
    except (MemoryError, KeyboardInterrupt):
        raise
    except H3QuantError as exc:
        code = exc.code if exc.code in _KNOWN else "X101"
        out.append(Finding(code, f"{stage}: {exc.reason}", tensor=exc.tensor or tensor,
                           file=exc.path or where))
    except OSError as exc:
        out.append(Finding("C112", f"{stage}: read failed: {exc.strerror or exc}", tensor=tensor,
                           file=where))
    except Exception as exc:  # noqa: BLE001 - a broken input must never produce a traceback
        out.append(Finding("X101", f"{stage} check stopped by {type(exc).__name__}: {exc}",
                           tensor=tensor, file=where))
    return None


def _counts(findings: list[Finding]) -> dict[str, int]:
    counts = {s.value: 0 for s in Severity}
    for f in findings:
        counts[f.level.value] += 1
    return counts


def validate_checkpoint(path: str | os.PathLike, *, deep: bool = False,
                        mmap: bool = True, on_bytes=None,
                        loader: str | None = None) -> ValidateResult:
    """Check a checkpoint; ``ok`` is True when no ERROR finding was produced. ``loader``
    (``comfyui``, ``vllm-omni``, ``comfyui-gguf``) adds that loader's acceptance rules."""
    from h3quant.pipelines.loaders import LOADERS, loader_findings

    if loader is not None and loader not in LOADERS:
        raise UsageError(f"--loader {loader!r}: expected one of {', '.join(LOADERS)}")
    res = _validate(path, deep, mmap, on_bytes, loader)
    if loader is not None:
        q = res.checked.pop("_quantized", None) or {}
        topo = res.checked.get("topology") or {}
        extra = loader_findings(res.path, loader, formats={n: f["format"] for n, f in q.items()},
                                fields=q, form=topo.get("form"),
                                gguf=res.checked.get("container") == "gguf")
        res = _result(Path(res.path), deep, res.findings + extra, res.checked, res.loads)
        res.loader = loader
    res.checked.pop("_quantized", None)
    return res


def _validate(path, deep: bool, mmap: bool, on_bytes, loader) -> ValidateResult:
    p = Path(path)
    if not p.exists():
        raise ContainerError("no such file or directory", path=p, code="C112")
    from h3quant.formats.gguf.reader import is_gguf

    if is_gguf(p):  # a GGUF file: its own header and type rules, then the H3 topology
        from h3quant.pipelines.headers.gguf import validate_gguf

        n, gfindings = validate_gguf(p, deep=deep)
        return _result(p, deep, gfindings, {"files": 1, "container": "gguf", "tensors": n,
                                            "stages": ["gguf", "topology"]
                                            + (["deep"] if deep else [])})
    with Checkpoint(p, mmap=mmap, strict=False) as ckpt:
        findings = list(ckpt.findings)
        io = [f for f in findings if f.code == "C112"]
        if io:
            raise ContainerError(io[0].message, path=io[0].file or p, code="C112")
        checked: dict = {"files": len(ckpt.files), "tensors": len(ckpt.tensors), "layers": 0,
                         "quantized_layers": 0, "topology": None, "stages": ["container"]}
        if any(f.code in FATAL_CODES for f in findings) or not ckpt.files:
            return _result(p, deep, findings, checked)
        if _statistics(ckpt, p, findings, checked):
            return _result(p, deep, findings, checked)
        layer_scan = _checks(ckpt, deep, findings, checked, on_bytes=on_bytes)
        quantized = {} if layer_scan is None else {n: dict(lay.fields)
                                                   for n, lay in layer_scan.quantized.items()}
        checked["_quantized"] = quantized
        from h3quant.pipelines.loaders import load_lines

        return _result(p, deep, findings, checked,
                       load_lines(f["format"] for f in quantized.values()))


def _statistics(ckpt: Checkpoint, p: Path, findings: list[Finding], checked: dict) -> bool:
    """A statistics file ('h3quant capture'): checked as convert and plan check it when they
    open it (K101), instead of as a checkpoint. True when ``ckpt`` is one."""
    from h3quant.calibration.meta import META_KEY

    if META_KEY not in ckpt.metadata or ckpt.is_sharded:
        return False
    from h3quant.calibration.stats import Statistics  # reads the values: torch

    checked["stages"].append("statistics")
    try:
        with Statistics(p):
            pass
    except H3QuantError as e:
        reason = e.reason.removeprefix("--calibration: ")
        findings.append(Finding("K101", reason, tensor=e.tensor, file=str(p)))
    return True


def header_findings(ckpt: Checkpoint, got=None) -> list[Finding]:
    """The findings ``validate`` (without ``--deep``) reports for the open ``ckpt``; ``inspect``
    counts these, so both commands give one verdict. ``got``: a ``scan`` already made (inspect
    reads markers from the header when it describes them; validate also reads the marker
    tensors, so only a marker tensor that disagrees with the header (M110) is validate's
    alone)."""
    findings = list(ckpt.findings)
    checked: dict = {"stages": []}
    if not any(f.code in FATAL_CODES for f in findings) and ckpt.files:
        _checks(ckpt, False, findings, checked, got)
    return findings


def _checks(ckpt: Checkpoint, deep: bool, findings: list[Finding], checked: dict,
            got=None, on_bytes=None):
    """Run the header (and with ``deep``, data) checks; the layer scan, or None."""
    where = str(ckpt.path)
    if got is None:
        got = _guard("marker scan", where, findings, lambda: scan(ckpt, prefer_header=False))
    if got is None:
        return None
    layer_scan = got[0]
    scaled = fp8_scaled(ckpt)  # ComfyUI's scaled fp8: a scale companion, no marker
    findings.extend(f for f in layer_scan.findings
                    if not (f.code == "M109" and f.tensor in scaled))
    findings.extend(_guard("scaled fp8 marker", where, findings,
                           naming_view.scaled_fp8_findings, ckpt) or [])
    unread = unread_metadata(ckpt.metadata)
    if unread:
        findings.append(Finding("M116", f"{len(unread)} metadata key(s) neither ComfyUI's "
                                f"loader nor h3quant reads, kept and ignored: "
                                f"{', '.join(unread[:8])}" + (" ..." if len(unread) > 8 else ""),
                                file=where))
    checked["stages"].append("markers")
    checked["layers"] = len(layer_scan.layers)
    checked["quantized_layers"] = len(layer_scan.quantized)

    for layer in layer_scan.layers.values():
        if layer.fields is None or layer.weight is None:
            continue  # plain float layer, or a marker without weight (M108 says so)
        res = _guard("scheme", where, findings, check_layer, layer, tensor=layer.name)
        findings.extend(res or [])
    checked["stages"].append("schemes")

    res = _guard("topology", where, findings, _topology, ckpt, layer_scan, checked)
    findings.extend(res or [])
    checked["stages"].append("topology")

    if deep:
        from h3quant.formats.deep import deep_check

        res = _guard("deep data", where, findings, deep_check, ckpt, layer_scan, on_bytes)
        findings.extend(res or [])
        if scaled:
            _guard("fp8 scales", where, findings, naming_view.check_scale_values, ckpt)
        checked["stages"].append("deep")
    return layer_scan


def _topology(ckpt: Checkpoint, layer_scan, checked: dict) -> list[Finding]:
    try:
        from h3quant.h3 import topology
    except ModuleNotFoundError as exc:
        if exc.name == "h3quant.h3.topology":
            return []
        raise
    named, viewed = naming_view.view(ckpt)  # N301-N305 raised, listed by _guard
    checked["naming"] = named
    tensors = ckpt.tensors if viewed is None else viewed  # as ComfyUI names them
    quantized = ({n: lay.fields["format"] for n, lay in layer_scan.quantized.items()}
                 if viewed is None else {})
    detection = topology.detect(tensors, quantized)
    if detection is None:  # the block index limit holds for any file (convert refuses it)
        beyond = [replace(f, file=str(ckpt.path)) for n in tensors
                  if (f := topology.beyond_limit_finding(n)) is not None]
        return [Finding("T104", "tensor names and shapes match no MiniMax H3 DiT configuration; "
                        "topology checks skipped", file=str(ckpt.path)), *beyond]
    checked["topology"] = topology.summary(detection, quantized)
    return list(topology.check(tensors, detection, quantized))


fp8_scaled = naming_view.fp8_scaled


def _result(p: Path, deep: bool, findings: list[Finding], checked: dict,
            loads: dict[str, str] | None = None) -> ValidateResult:
    counts = _counts(findings)
    return ValidateResult(str(p), deep, findings, counts, counts["error"] == 0, checked,
                          loads or {})
