"""Guards on the code base itself: lint, import layers, torch-free header-only commands, no
private imports across modules, self-contained docs, and a README that CI actually runs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "h3quant"
SOURCES = sorted(PKG.rglob("*.py"))


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, **kw)


def test_ruff_is_clean():
    """ruff with the pyproject configuration finds nothing in the package, tests and benches."""
    proc = _run("-m", "ruff", "check", "--no-cache", "h3quant", "tests", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_contracts_are_kept():
    """import-linter: layers cli > pipelines > runtime > h3 > formats > convrot, no production import
    of the simulations, formats independent of the runtime (contracts in pyproject.toml)."""
    proc = _run("-c", "import sys; from importlinter.cli import lint_imports; "
                      "sys.exit(lint_imports(no_cache=True, no_logo=True))")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    declared = (ROOT / "pyproject.toml").read_text(encoding="utf-8").count(
        "[[tool.importlinter.contracts]]")
    assert declared >= 13  # the layers, formats, device records and backends-tp contracts
    assert "0 broken" in proc.stdout and f"{declared} kept" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_package_type_checks():
    """mypy over the whole h3quant package (pyproject.toml's [tool.mypy] names it)."""
    proc = _run("-m", "mypy", "--no-incremental")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout, proc.stdout


def test_package_ships_its_type_hints():
    assert (PKG / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'h3quant = ["py.typed"]' in text


def import_cycles(package: str) -> list[list[str]]:
    """Every import circle among ``package``'s modules (strongly connected components of more
    than one module, function-level imports included), found with grimp, import-linter's own
    graph builder."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (deep graphs, no recursion limit)
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in order:
                    order[child] = low[child] = len(order)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], order[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_circles():
    assert import_cycles("h3quant") == []


def package_loops(package: str) -> list[tuple[str, str]]:
    """Pairs of sibling packages that import each other, directly or through others (a module
    belongs to the package that holds it; imports between a package and its own subpackages
    are not loops)."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    packages = {m for m in graph.modules if graph.find_children(m)} | {package}

    def home(m: str) -> str:
        return m if m in packages else m.rsplit(".", 1)[0]

    def nested(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    edges: dict[str, set[str]] = {}
    for m in graph.modules:
        for d in graph.find_modules_directly_imported_by(m):
            if not nested(home(m), home(d)):
                edges.setdefault(home(m), set()).add(home(d))

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for y in edges.get(todo.pop(), ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return seen

    reached = {a: reach(a) for a in edges}
    return sorted({(min(a, b), max(a, b)) for a in edges for b in reached[a]
                   if b in reached and a in reached[b] and a != b})


def test_no_package_loops():
    """No two packages import each other (the runtime's backends and tensor parallel did,
    through TpError, which now lives in h3quant.errors)."""
    assert package_loops("h3quant") == []


def test_package_loop_detector_finds_a_planted_loop(tmp_path, monkeypatch):
    root = tmp_path / "loopy"
    for sub in ("a", "b", "c"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("def f():\n    from loopy.b import y\n")
    (root / "b" / "y.py").write_text("import loopy.a.x\n")
    (root / "c" / "z.py").write_text("import loopy.a.x\nimport loopy.c\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_loops("loopy") == [("loopy.a", "loopy.b")]


def test_import_circle_detector_finds_a_planted_circle(tmp_path, monkeypatch):
    """A three-module circle through a function-level import, and a clean module beside it."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted import b\n")
    (pkg / "b.py").write_text("def f():\n    from planted.c import g\n    return g\n")
    (pkg / "c.py").write_text("import planted.a\n\ndef g():\n    return 1\n")
    (pkg / "d.py").write_text("from planted import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("planted") == [["planted.a", "planted.b", "planted.c"]]


@pytest.mark.slow
def test_header_only_commands_do_not_import_torch(tmp_path):
    """inspect and validate (without --deep) read headers and markers only; importing their
    command modules and running them on a real quantized file leaves torch unimported."""
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    src, dst = tmp_path / "bf16.safetensors", tmp_path / "int8.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1)
    convert(src, dst, ConvertOptions(target="int8-convrot", report=False, workers=1))
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import h3quant.cli.inspect_cmd, h3quant.cli.validate_cmd, h3quant.formats.registry\n"
        "from h3quant.cli import main\n"
        f"for args in (['inspect', {str(dst)!r}, '--layers'], ['validate', {str(dst)!r}]):\n"
        "    r = CliRunner().invoke(main, args)\n"
        "    assert r.exit_code == 0, (args, r.output)\n"
        "print('torch' in sys.modules)\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False", "torch was imported"


def _private_imports(path: Path) -> list[str]:
    """``from h3quant.x import _name`` and ``module._name`` on an imported h3quant module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    modules, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h3quant"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{where}:{node.lineno} imports {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names
                           if a.name.startswith("h3quant"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            out.append(f"{where}:{node.lineno} uses {node.value.id}.{node.attr}")
    return out


def test_no_private_imports_across_modules():
    found = [hit for p in SOURCES for hit in _private_imports(p)]
    assert not found, "\n".join(found)


def test_private_import_detector_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from h3quant.formats.markers import _x\nfrom h3quant.formats import markers\n"
                   "markers._y\n")
    assert len(_private_imports(bad)) == 2


def _test_module_imports(path: Path) -> list[str]:
    """Imports of a test module (``test_*``, ``tests.*``): shared helpers live in tests/helpers/
    and tests/conftest.py, never in a test module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    return [f"{path.name} imports {n}" for n in names
            if n.split(".")[0].startswith("test_") or n == "tests" or n.startswith("tests.")]


def test_no_test_module_imports_another():
    found = [hit for p in sorted((ROOT / "tests").rglob("*.py")) for hit in _test_module_imports(p)]
    assert not found, "\n".join(found)


def test_test_import_detector_can_fail(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("from test_convert import small_h3\nimport tests.test_block\nfrom helpers import forge\n")
    assert len(_test_module_imports(bad)) == 2


def test_block_linears_defined_once():
    owners = [str(p.relative_to(ROOT)) for p in SOURCES
              for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
              if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "BLOCK_LINEARS" for t in node.targets)]
    assert owners == ["h3quant/h3/topology.py"]


# Words that only make sense next to files users do not have, or to a review's numbering.
_FOREIGN = [re.compile(r"\.\./" + "shared"), re.compile("seed " + r"failure\s+\d", re.I)]


def test_code_docs_and_tests_are_self_contained():
    files = [p for p in [*SOURCES, *sorted((ROOT / "tests").rglob("*.py")),
                         *sorted((ROOT / "bench").rglob("*.py")), ROOT / "README.md",
                         *sorted((ROOT / "docs").rglob("*.md"))] if p.is_file()]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if any(rx.search(line) for rx in _FOREIGN)]
    assert not hits, "\n".join(hits)


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README has no opening bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert all(c.startswith("python3 -m venv .venv && ") for c in cmds), cmds
    assert "h3quant demo" in cmds[0] and "pytest" in cmds[1]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert cmds[1] in ci, f".ci/run does not run the README's test command {cmds[1]!r}"


@pytest.mark.slow
def test_suite_started_with_sigint_ignored_still_interrupts_its_children(tmp_path):
    """A suite started in the background by a script (``pytest &``, nohup) inherits SIGINT
    ignored; the Ctrl-C tests must still see a convert that SIGINT reaches, as from a terminal.
    Without the conftest's reset their children stay deaf to SIGINT and the tests fail."""
    import signal

    res = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
               "tests/pipelines/convert/test_convert_safety.py::test_sigint_mid_run_leaves_nothing[1-60]",
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


README_MAX_BYTES = 14 * 1024  # read in five minutes; the rest lives in docs/


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _readme_links(text: str) -> list[str]:
    """Every link target of a Markdown text: inline ``[a](url)`` and reference ``[a]: url``."""
    return (re.findall(r"\]\(([^)\s]+)\)", text)
            + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M))


def test_readme_is_short_and_its_links_work_on_pypi():
    """PyPI shows the README as the project description, where a relative link is dead: every
    link is absolute, and one into the repository names a file (and heading) that exists."""
    tomllib = pytest.importorskip("tomllib")
    raw = (ROOT / "README.md").read_bytes()
    assert len(raw) <= README_MAX_BYTES, f"README.md is {len(raw)} bytes"
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Source"]
    links = _readme_links(raw.decode("utf-8"))
    ours = [u for u in links if u.startswith(repo + "/blob/main/")]
    assert not [u for u in links if not u.startswith("https://")], links
    assert any(u.endswith("/docs/FORMATS.md") for u in ours) and len(ours) >= 5, ours
    for url in ours:
        path, _, anchor = url.removeprefix(repo + "/blob/main/").partition("#")
        target = ROOT / path
        assert target.is_file(), url
        if anchor:
            heads = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
            assert anchor in {_slug(h) for h in heads}, url


def test_the_link_checks_catch_planted_faults():
    assert _readme_links("see [a](docs/x.md) and\n[b]: https://e.org/y#z\n") == [
        "docs/x.md", "https://e.org/y#z"]
    assert _slug("6. Devices") == "6-devices"
    assert _slug("Which file is good? Compare them") == "which-file-is-good-compare-them"


def test_what_left_the_readme_lives_in_the_user_guide():
    """The versions table, convert_to_quant's option map and the long notes moved to
    docs/guide.md, which the README links."""
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    for needle in ["| format (`--to`) | ComfyUI | comfy-kitchen |",
                   "| convert_to_quant | h3quant |", "`--layer-config FILE`",
                   "## Python API", "## Guarantees", "## Windows", "## Known limits",
                   "## Tensor parallel", "## Bake a LoRA", "pip install 'h3quant[all]'"]:
        assert needle in guide, needle
    assert "/docs/guide.md" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["torch", "click", "tqdm", "numpy"])
def test_runtime_dependencies_are_imported_by_the_package(name):
    """Every runtime dependency is imported by h3quant itself (test-only ones live in the extra;
    torch in its own extra, as inspect and validate run without it)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["torch"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() for d in deps}
    used = any(re.search(rf"^\s*(import|from) {name}\b", p.read_text(encoding="utf-8"), re.M)
               for p in SOURCES)
    assert (name in names) == used, f"{name}: declared={name in names} imported={used}"


def _names(reqs) -> set[str]:
    return {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower().replace("-", "_") for d in reqs}


@pytest.mark.slow
def test_no_undeclared_runtime_dependency():
    """Every third-party module h3quant imports is a dependency, or an optional extra's (imported
    only where that feature is used: torch_npu for Ascend, matplotlib for plots); every
    dependency is imported."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    # the bench extra serves bench/ (not the package): its packages are named there
    optional = set().union(*(_names(v) for k, v in extras.items()
                             if k not in ("test", "bench"))) - {"h3quant"}
    bench_text = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "bench").glob("*.py"))
    for name in _names(extras.get("bench", [])):
        assert name.replace("_", "-") in bench_text or name in bench_text, f"bench extra {name} unused"
    stdlib = set(sys.stdlib_module_names)
    imported = set()
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    # comfy_kitchen is an optional CUDA backend, used only when it is installed; comfy and
    # folder_paths are ComfyUI's own modules, imported by h3quant.comfy's node inside ComfyUI.
    third = imported - stdlib - {"h3quant", "comfy_kitchen", "comfy", "folder_paths"}
    assert third <= declared | optional, f"imported but not declared: {sorted(third - declared - optional)}"
    assert optional <= third, f"optional extra never imported: {sorted(optional - third)}"
    assert declared <= third, f"declared but never imported: {sorted(declared - third)}"


def test_a_dtype_this_torch_lacks_is_a_clear_error(monkeypatch):
    """Reading F8_E8M0 data needs torch >= 2.7; older torch gets a specific error, not a crash."""
    import torch

    from h3quant.errors import UnsupportedError
    from h3quant.formats.container.dtypes import to_torch

    monkeypatch.delattr(torch, "float8_e8m0fnu", raising=False)
    with pytest.raises(UnsupportedError, match="no float8_e8m0fnu"):
        to_torch("F8_E8M0")
    assert to_torch("I8") is torch.int8


@pytest.mark.parametrize("module, names", [
    ("h3quant.pipelines", ["inspect_checkpoint", "validate_checkpoint"]),
    ("h3quant.pipelines.convert", ["ConvertOptions", "convert", "plan_convert", "write_report"]),
    ("h3quant.pipelines.verify", ["verify_checkpoint", "Thresholds", "verify_model", "ModelInputs",
                                  "verify_tp"]),
    ("h3quant.runtime.model", ["H3Model"]),
    ("h3quant.runtime", ["QuantizedLinear", "select_backend", "parse_device"]),
    ("h3quant.formats.rules", ["layer_violations", "fit_error", "scale_violations"]),
])
def test_public_names_stay_importable(module, names):
    """The names the README and earlier releases import keep working after the package moves."""
    import importlib

    mod = importlib.import_module(module)
    missing = [n for n in names if not callable(getattr(mod, n, None))]
    assert not missing, f"{module} lacks {missing}"


# A size shown to people is formatted by h3quant.sizes only: one style (GB or MB, two decimals).
_SIZE_MATH = re.compile(r"/\s*(1e6|1e9|1_000_000|2\s*\*\*\s*[23]0|\(?1\s*<<\s*[23]0\)?)\b")
_SIZE_UNITS = re.compile(r"\b(KiB|MiB|GiB|kB)\b")


def _size_formatting(path: Path) -> list[str]:
    """Lines of ``path`` that scale bytes to a unit themselves, or print KiB/MiB/GiB/kB in an
    f-string (help texts may quote a limit such as '16 MiB')."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(lines, 1)
            if _SIZE_MATH.search(line) and "_per_s" not in line]  # a rate is not a size
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
            if any(_SIZE_UNITS.search(str(p)) for p in parts):
                hits.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return hits


def test_sizes_have_one_style():
    owner = ROOT / "h3quant" / "sizes.py"
    hits = [f"{p.relative_to(ROOT)}:{h}" for d in ("cli", "pipelines")
            for p in sorted((ROOT / "h3quant" / d).rglob("*.py")) if p != owner
            for h in _size_formatting(p)]
    assert not hits, "sizes formatted outside h3quant/sizes.py:\n" + "\n".join(hits)


def test_the_size_style_check_finds_planted_formatting(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('a = f"{n / 1e6:.1f} MB"\nb = f"{n / 2**20:.1f}"\nc = f"{x} MiB"\n'
                   'd = "at most 16 MiB"\ne = f"{n / 1e6 / t:.1f} MB/s"  # input_mb_per_s\n')
    assert [h.split(":")[0] for h in _size_formatting(bad)] == ["1", "2", "3"]


def _prints(path: Path) -> list[int]:
    """Lines of a test module that write to the terminal past pytest's capture: a print() call,
    capsys/capfd.disabled(), or a write to sys.stdout / sys.stderr / their originals. (A child
    script's print inside a string literal is not a call here.)"""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            out.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "disabled" and isinstance(f.value, ast.Name) \
                and f.value.id in ("capsys", "capfd", "capsysbinary", "capfdbinary"):
            out.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "write" and isinstance(f.value, ast.Attribute) \
                and f.value.attr in ("stdout", "stderr", "__stdout__", "__stderr__"):
            out.append(node.lineno)
    return sorted(out)


def test_no_test_prints_into_pytest_q():
    """pytest -q shows dots and the verdict only: a test's figures go to logging (shown with
    --log-cli-level=INFO) or into its assertion messages."""
    hits = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "tests").rglob("*.py"))
            for line in _prints(p)]
    assert not hits, "tests writing to the terminal:\n" + "\n".join(hits)


def test_the_print_check_finds_planted_prints(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import sys\nprint(1)\nwith capsys.disabled():\n    pass\n"
                   "sys.stdout.write('x')\nchild = \"print('fine: a string')\"\n"
                   "sys.__stderr__.write('y')\n")
    assert _prints(bad) == [2, 3, 5, 7]
