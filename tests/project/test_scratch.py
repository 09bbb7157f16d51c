"""The suite's scratch stays small: a session-scoped fixture names its directory with the session
prefix (tests/conftest.py removes every other fixture directory when its module ends), so no
session fixture's files vanish under a later module, and no module's files outlive it."""

import ast
from pathlib import Path

from helpers.scratch import SESSION_SCRATCH

TESTS = Path(__file__).resolve().parents[1]


def _fixture_scope(func: ast.FunctionDef) -> str | None:
    for dec in func.decorator_list:
        if isinstance(dec, ast.Call):
            for kw in dec.keywords:
                if kw.arg == "scope" and isinstance(kw.value, ast.Constant):
                    return str(kw.value.value)
    return None


def _mktemp_names(func: ast.FunctionDef) -> list[ast.expr]:
    return [
        node.args[0]
        for node in ast.walk(func)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "mktemp"
        and node.args
    ]


def _has_session_prefix(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Constant):
        return str(arg.value).startswith(SESSION_SCRATCH)
    return isinstance(arg, ast.BinOp) and isinstance(arg.left, ast.Name) and arg.left.id == "SESSION_SCRATCH"


def test_session_fixtures_name_their_scratch_with_the_session_prefix():
    checked, wrong = 0, []
    for path in TESTS.rglob("*.py"):
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(func, ast.FunctionDef) or _fixture_scope(func) != "session":
                continue
            for arg in _mktemp_names(func):
                checked += 1
                if not _has_session_prefix(arg):
                    wrong.append(f"{path.relative_to(TESTS)}:{arg.lineno} {func.name}")
    assert checked >= 3, "the session fixtures that make directories were not found"
    assert not wrong, f"session fixtures whose scratch would be removed with a module: {wrong}"


def test_module_fixtures_do_not_use_the_session_prefix():
    wrong = []
    for path in TESTS.rglob("*.py"):
        for func in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(func, ast.FunctionDef) and _fixture_scope(func) != "session":
                names = _mktemp_names(func)
                wrong += [f"{path.relative_to(TESTS)}:{a.lineno}" for a in names if _has_session_prefix(a)]
    assert not wrong, f"scratch that would outlive its module: {wrong}"
