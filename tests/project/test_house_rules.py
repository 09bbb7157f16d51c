"""The house rules: a format's wire name, a source layout's name and a device kind's name appear
only in their own modules (no special case by name anywhere else), and every format package
exports its SPEC and CODEC through the one registry."""

import ast
import importlib
from pathlib import Path

import pytest

from h3quant.formats import registry
from h3quant.h3 import layouts
from h3quant import device_kinds
from h3quant.errors import TpError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "h3quant"


def _docstrings(tree) -> set[int]:
    """ids of the docstring nodes (module, class, function): prose may name a format."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _literals(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string literal in ``path`` equal to one of ``names``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
            and id(n) not in skip]


def _owner_of_format(name: str) -> Path:
    """The format package that registers ``name`` (``h3quant/formats/comfy_known.py`` for a
    spec-only entry)."""
    for pkg in registry.packages():
        mod = importlib.import_module(pkg)
        if name in {s.name for s, _ in getattr(mod, "FORMATS", ((mod.SPEC, mod.CODEC),))}:
            return PKG.joinpath(*pkg.split(".")[1:])
    return PKG / "formats" / "comfy_known.py"


def test_wire_names_live_in_their_own_package():
    wire = {s.name for s in registry.specs() if s.quantized}
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        for line, name in _literals(path, wire):
            owner = _owner_of_format(name)
            # the container's dtype table names torch dtypes, two of which share fp8's wire names
            allowed = [owner, PKG / "formats" / "comfy_known.py",
                       PKG / "formats" / "container" / "dtypes.py"]
            if not any(path == a or a in path.parents for a in allowed):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {name!r}")
    assert not hits, "wire names outside their format's package:\n" + "\n".join(hits)


# "diffusers" is also a LoRA key style: the style registry and the LoRA writer own that word;
# the demo types user commands (``--naming official``) as a user would.
_LAYOUT_WORD_OWNERS = ("h3/layouts.py", "h3/lora.py", "synth/lora.py", "cli/demo_cmd.py")


def test_layout_names_live_in_the_layouts_registry():
    names = set(layouts.names())
    own = {PKG / p for p in _LAYOUT_WORD_OWNERS}
    hits = [f"{p.relative_to(ROOT)}:{line}: {name!r}"
            for p in sorted(PKG.rglob("*.py")) if p not in own
            for line, name in _literals(p, names)]
    assert not hits, "source layout names outside h3/layouts.py:\n" + "\n".join(hits)


# The device modules: the records, the parser, the probes of what a machine has, the backends
# (one per device's int8 op) and the simulations of devices we lack.
_DEVICE_MODULES = ("device_kinds.py", "device_profiles.py", "runtime/devices.py", "runtime/probe.py",
                   "runtime/capabilities.py", "runtime/availability.py", "runtime/backends",
                   "testing")
# Reviewed exceptions, each a fact that is not a decision by device kind:
_DEVICE_WORD_EXCEPTIONS = {
    # "npu" is also the name of int8's pre-transposed layout (convert --layout npu)
    ("formats/int8_kn/spec.py", "npu"), ("formats/int8_kn/tensors.py", "npu"),
    ("pipelines/convert/options.py", "npu"), ("pipelines/convert/recipe.py", "npu"),
    ("cli/convert_cmd.py", "npu"),
    # a format states where ComfyUI runs comfy-kitchen's eager INT4 path (formats know no runtime)
    ("formats/int4_convrot/spec.py", "mps"), ("formats/int4_convrot/spec.py", "xpu"),
    # ... and where its eager AWQ W4A16 linear runs (kitchen's AWQ kernels are CUDA / ROCm only)
    ("formats/awq_w4a16/spec.py", "mps"), ("formats/awq_w4a16/spec.py", "xpu"),
    ("formats/awq_w4a16/spec.py", "npu"),
    # a format's kernel (spec.runtime.kernel) is a CUDA kernel with a minimum sm capability
    ("runtime/decoded.py", "cuda"),
}


def test_device_kinds_live_in_the_device_modules():
    """No special case by a device's name outside the device modules: code asks the kind's
    record (h3quant.device_kinds) for its backend, dtype, collective and help text. "cpu" is
    left out: it is the host every tensor can move to (``.to("cpu")``, the float reference)."""
    kinds = set(device_kinds.names()) - {device_kinds.HOST.name}
    assert {"cuda", "npu", "mps"} <= kinds
    own = [PKG / p for p in _DEVICE_MODULES]
    hits = [f"{p.relative_to(ROOT)}:{line}: {name!r}"
            for p in sorted(PKG.rglob("*.py"))
            if not any(p == o or o in p.parents for o in own)
            for line, name in _literals(p, kinds)
            if (p.relative_to(PKG).as_posix(), name) not in _DEVICE_WORD_EXCEPTIONS]
    assert not hits, "device kinds named outside the device modules:\n" + "\n".join(hits)


def test_device_word_exceptions_are_still_needed():
    """Every reviewed exception still names a literal its file holds (a stale one is removed)."""
    kinds = set(device_kinds.names())
    stale = [(f, w) for f, w in sorted(_DEVICE_WORD_EXCEPTIONS)
             if w not in {name for _, name in _literals(PKG / f, kinds)}]
    assert not stale, stale


def test_the_detector_finds_a_planted_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions int8_tensorwise in prose: fine."""\n'
                   'if fmt == "int8_tensorwise":\n    pass\n')
    assert _literals(bad, {"int8_tensorwise"}) == [(2, "int8_tensorwise")]


def test_every_format_package_exports_spec_and_codec():
    import importlib

    for pkg in sorted(p for p in (PKG / "formats").iterdir()
                      if (p / "spec.py").is_file()):
        mod = importlib.import_module(f"h3quant.formats.{pkg.name}")
        assert registry.spec(mod.SPEC.name) is mod.SPEC, pkg.name
        assert mod.CODEC is None or mod.CODEC.spec is mod.SPEC, pkg.name


def _format_packages() -> set[str]:
    """Every format package (a folder of h3quant/formats with a spec.py), as a module name."""
    return {f"h3quant.formats.{p.name}" for p in (PKG / "formats").iterdir()
            if (p / "spec.py").is_file()}


def _format_imports(path: Path, packages: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` of one of ``packages`` or a module inside one
    (``import a.b``, ``from a.b import c``, ``from a import b``; at any depth of the file)."""
    def hit(mod: str) -> bool:
        return any(mod == p or mod.startswith(p + ".") for p in packages)

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if hit(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            out += [(node.lineno, m) for m in mods if hit(m)][:1]
    return sorted(out)


def test_pipelines_import_no_format_package():
    """A pipeline asks the registry (specs, codecs and their hooks), never a format package."""
    packages = _format_packages()
    owners = {".".join(("h3quant", *_owner_of_format(s.name).relative_to(PKG).parts))
              for s in registry.specs() if registry.get(s.name) is not None}
    assert owners - {"h3quant.formats"} <= packages and len(packages) >= 8, (owners, packages)
    hits = [f"{p.relative_to(ROOT)}:{line}: {mod}"
            for p in sorted((PKG / "pipelines").rglob("*.py"))
            for line, mod in _format_imports(p, packages)]
    assert not hits, "pipelines importing a format package:\n" + "\n".join(hits)


def test_the_import_detector_finds_planted_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from h3quant.formats import registry\n"
                   "from h3quant.formats.w4a8.codebook import X\n"
                   "def f():\n    import h3quant.formats.int8_kn.tensors\n"
                   "from h3quant.formats import fp8\n"
                   "from h3quant.formats.int8x import y\n")
    got = _format_imports(bad, {"h3quant.formats.w4a8", "h3quant.formats.int8_kn",
                                "h3quant.formats.fp8", "h3quant.formats.int8"})
    assert got == [(2, "h3quant.formats.w4a8.codebook"), (4, "h3quant.formats.int8_kn.tensors"),
                   (5, "h3quant.formats.fp8")]


# ----------------------------------------------------------------------------- one dispatch
def test_tp_int32_matmul_comes_from_the_backend_registry(monkeypatch):
    """The shared-scale matmul is the first backend of the device's preference order that has
    one: a backend planted at the head of the CPU order is chosen, with no device-kind test."""
    import torch

    from h3quant.runtime import backends
    from h3quant.runtime.backends.base import Backend
    from h3quant.runtime.devices import Device
    from h3quant.runtime.probe import StaticProbe
    from h3quant.runtime.tp.linears import int32_matmul_fn

    class Planted(Backend):
        name = "planted"

        def int32_matmul(self, device, probe):
            return lambda q_x, w_t: torch.full((q_x.shape[0], w_t.shape[1]), 7, dtype=torch.int32)

    monkeypatch.setitem(backends.BACKENDS, "planted", Planted())
    monkeypatch.setitem(backends.PREFERENCE, "cpu", ("planted", *backends.PREFERENCE["cpu"]))
    fn = int32_matmul_fn(Device("cpu"), StaticProbe())
    q = torch.ones(2, 4, dtype=torch.int8)
    assert torch.equal(fn(q, q.t()), torch.full((2, 2), 7, dtype=torch.int32))
    monkeypatch.setitem(backends.PREFERENCE, "cpu", ("dequant",))  # none has an int32 matmul
    with pytest.raises(TpError, match="no backend offers one"):
        int32_matmul_fn(Device("cpu"), StaticProbe())


def test_tp_int32_matmul_on_npu_is_the_npu_backends():
    from h3quant.runtime.backends.npu import NpuBackend
    from h3quant.runtime.devices import Device
    from h3quant.runtime.probe import StaticProbe

    with pytest.raises(TpError, match="torch_npu is not importable"):
        NpuBackend().int32_matmul(Device("npu"), StaticProbe())


# The import contracts that name every format package, less the packages each leaves out on
# purpose (with the contract that covers them instead).
_CONTRACT_LEFT_OUT = {
    # int8_kn builds on int8 ("The NPU layout builds on int8 only"); mxfp8 on fp8's rules
    # ("mxfp8 builds on fp8's rules only")
    "Format packages stand alone: none imports another": {"h3quant.formats.int8_kn",
                                                          "h3quant.formats.mxfp8"},
    # a contract about one package leaves out that package and the one it builds on
    "mxfp8 builds on fp8's rules only": {"h3quant.formats.fp8", "h3quant.formats.mxfp8"},
    "The NPU layout builds on int8 only": {"h3quant.formats.int8", "h3quant.formats.int8_kn"},
}


def _contract_mismatches(contracts: list[dict], packages: set[str]) -> list[str]:
    """Contracts whose lists of format packages disagree with the registry's ``packages``: a
    list naming most of them (an "every format" list) must name all of them, less its reviewed
    exceptions, and no contract may name a format package the registry lacks."""
    out = []
    for c in contracts:
        for key in ("modules", "source_modules", "forbidden_modules"):
            named = {m for m in c.get(key, ()) if m.startswith("h3quant.formats.")
                     and (PKG / "formats" / m.split(".")[2] / "spec.py").is_file()
                     or m in packages}
            stale = named - packages
            if stale:
                out.append(f"{c['name']!r} {key} names unregistered {sorted(stale)}")
            if 2 * len(named & packages) > len(packages):  # an "every format" list
                missing = packages - named - _CONTRACT_LEFT_OUT.get(c["name"], set())
                if missing:
                    out.append(f"{c['name']!r} {key} lacks {sorted(missing)}")
    return out


def _contracts() -> list[dict]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_import_contracts_name_the_registered_format_packages():
    """A new format package is one line in the registry; the contracts that list every format
    package must then list it too (this test says which), and none names a removed one."""
    problems = _contract_mismatches(_contracts(), set(registry.packages()))
    assert not problems, "\n".join(problems)
    assert set(_CONTRACT_LEFT_OUT) <= {c["name"] for c in _contracts()}, "stale exception"


def test_the_contract_check_finds_a_missing_and_a_stale_package():
    import copy

    contracts = copy.deepcopy(_contracts())
    packages = set(registry.packages())
    every = next(c for c in contracts if c.get("forbidden_modules")
                 and set(packages) <= set(c["forbidden_modules"]))
    every["forbidden_modules"].remove("h3quant.formats.w4a8")
    assert _contract_mismatches(contracts, packages) == [
        f"{every['name']!r} forbidden_modules lacks ['h3quant.formats.w4a8']"]
    every["forbidden_modules"].append("h3quant.formats.w4a8")
    assert _contract_mismatches(contracts, packages | {"h3quant.formats.gone"}) != []
    assert _contract_mismatches(contracts, packages - {"h3quant.formats.plain"}) != []


def _format_package_codes() -> dict[str, set[str]]:
    """Finding codes (``"Q130"``) each format package's modules name as string literals."""
    import re

    out: dict[str, set[str]] = {}
    for pkg in sorted(p for p in (PKG / "formats").iterdir() if (p / "spec.py").is_file()):
        for path in pkg.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"[A-Z]\d{3}", node.value):
                    out.setdefault(node.value, set()).add(pkg.name)
    return out


def test_format_finding_codes_are_registered_by_their_package():
    """A code that only one format package reports is registered by that package, not in the
    central list of ``h3quant.findings``; ``validate --codes`` (a fresh process) lists them all."""
    import json
    import subprocess
    import sys

    code = ("import json, h3quant.findings as f; central = [r.code for r in f.all_rules()]; "
            "import h3quant.formats.registry; print(json.dumps([central, "
            "[r.code for r in f.all_rules()]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    central, everything = (set(x) for x in json.loads(out.stdout))
    used_elsewhere = set()
    for path in PKG.rglob("*.py"):
        if (PKG / "formats") in path.parents and path.parent != PKG / "formats":
            continue
        used_elsewhere |= {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                           if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    own = {c for c, pkgs in _format_package_codes().items()
           if len(pkgs) == 1 and c not in used_elsewhere}
    assert own, "no format-owned code found: the detector is broken"
    assert not own & central, f"format codes in the central list: {sorted(own & central)}"
    assert own <= everything - central, sorted(own - everything)
    listed = subprocess.run([sys.executable, "-m", "h3quant", "validate", "--codes", "--json"],
                            capture_output=True, text=True, check=True, cwd=ROOT)
    assert {d["code"] for d in json.loads(listed.stdout)} == everything


def test_a_finding_code_cannot_be_registered_twice_with_another_rule():
    from h3quant import findings

    r = findings.rule("Q130")
    findings.register(r.code, r.name, r.severity, r.rule)  # the same rule again: allowed
    with pytest.raises(ValueError, match="already registered"):
        findings.register("Q130", "another", r.severity, r.rule)
