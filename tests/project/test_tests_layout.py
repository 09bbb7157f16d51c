"""The test tree mirrors the package: a test file lives in the folder of the h3quant package it
mainly exercises (tests/formats/int8/ for h3quant/formats/int8/, tests/pipelines/convert/ for
h3quant/pipelines/convert/ ...), at the top of tests/ only when it tests a top-level module
(tests/test_alloc.py for h3quant/alloc.py), or in one of the few cross-cutting folders below."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Folders for tests that belong to no one package.
CROSS_CUTTING = {
    "project": "guards on the code base, its docs, packaging and benches",
    "robustness": "rules every command keeps: I/O rules, fault injection, bounded sizes, fuzzing",
}
NOT_TESTS = {"helpers", "data"}  # shared test code and test files, no test modules


def _misplaced(tests: Path, pkg: Path) -> list[str]:
    packages = {p.parent.relative_to(pkg).as_posix() for p in pkg.rglob("__init__.py")} - {"."}
    modules = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    bad = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        folder = rel.parent.as_posix()
        if folder == ".":
            ok = any(path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_") for m in modules)
        else:
            ok = folder in packages or rel.parts[0] in CROSS_CUTTING
        if not ok or rel.parts[0] in NOT_TESTS:
            bad.append(rel.as_posix())
    return bad


def test_every_test_file_lives_in_its_package_folder():
    bad = _misplaced(ROOT / "tests", ROOT / "h3quant")
    assert not bad, ("test files outside the mirror of h3quant's packages (move each into the folder "
                     "of the package it tests, or a cross-cutting folder of tests/project/"
                     "test_tests_layout.py):\n" + "\n".join(bad))


def test_the_layout_check_finds_misplaced_files(tmp_path):
    pkg, tests = tmp_path / "pkg", tmp_path / "tests"
    for d in (pkg / "formats" / "int8", tests / "formats" / "int8", tests / "format" / "int8",
              tests / "project", tests / "helpers"):
        d.mkdir(parents=True, exist_ok=True)
    for f in (pkg / "__init__.py", pkg / "formats" / "__init__.py", pkg / "formats" / "int8" / "__init__.py",
              pkg / "alloc.py"):
        f.write_text("")
    for name in ("formats/int8/test_codec.py", "format/int8/test_codec2.py", "project/test_guard.py",
                 "helpers/test_helper.py", "test_alloc.py", "test_alloc_more.py", "test_allocator.py"):
        (tests / name).write_text("")
    assert _misplaced(tests, pkg) == ["format/int8/test_codec2.py", "helpers/test_helper.py",
                                      "test_allocator.py"]
