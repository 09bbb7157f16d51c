"""Packaging: one version source, a LICENSE, project URLs and classifiers, a release entry in
the changelog, and torch an extra: without it inspect and validate work and the commands that
need it say so."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import h3quant

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_source():
    doc = _project()
    assert "version" not in doc["project"] and "version" in doc["project"]["dynamic"]
    assert doc["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "h3quant.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", h3quant.__version__)
    hits = [p for p in (ROOT / "h3quant").rglob("*.py")
            if re.search(r"^\s*__version__\s*=", p.read_text(), re.M)]
    assert hits == [ROOT / "h3quant" / "__init__.py"]


def test_changelog_has_a_release_entry_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    m = re.search(rf"^## \[{re.escape(h3quant.__version__)}\] - (\d{{4}}-\d{{2}}-\d{{2}})$",
                  text, re.M)
    assert m, f"no release entry for {h3quant.__version__}"
    assert text.index(m.group(0)) < text.index("## [0.1.0]")


def test_license_and_metadata_for_pypi():
    doc = _project()
    project = doc["project"]
    text = (ROOT / "LICENSE").read_text()
    # PEP 639: an SPDX expression and the license file; setuptools deprecates the table form and
    # the License :: classifiers (they may not be given with an expression)
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])
    tools = next(r for r in doc["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.fullmatch(r"setuptools>=(\d+)", tools).group(1)) >= 77, tools  # PEP 639 support
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert {"Homepage", "Source", "Issues", "Changelog"} <= set(project["urls"])
    assert "Operating System :: Microsoft :: Windows" in project["classifiers"]


def test_the_python_this_suite_runs_on_is_classified():
    """The classifiers name the Python versions the suite runs on: a CI on a new Python fails
    here until it is classified."""
    project = _project()["project"]
    here = f"Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}"
    assert here in project["classifiers"]
    floor = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    versions = [int(c.rsplit(".", 1)[1]) for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert floor and versions and min(versions) >= int(floor.group(1))


def test_the_all_extra_is_every_extra_that_runs_anywhere():
    """``[all]`` installs every optional feature (torch, GGUF, Hugging Face names, plots); only
    the platform-specific npu extra, the test extra and the benchmarks' bench extra (a model
    package the real-weights benchmark reads, no feature of h3quant) stay out."""
    extras = _project()["project"]["optional-dependencies"]
    m = re.fullmatch(r"h3quant\[([a-z,]+)\]", " ".join(extras["all"]))
    assert m, extras["all"]
    assert set(m.group(1).split(",")) == set(extras) - {"all", "npu", "test", "bench"}


def test_torch_is_an_extra_the_test_extra_includes():
    project = _project()["project"]
    assert not any(d.startswith("torch") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["torch"])
    assert "h3quant[torch]" in extras["test"]
    first = re.search(r"```bash\n(.*?)\n", (ROOT / "README.md").read_text()).group(1)
    assert "'.[torch]'" in first  # the README's first command installs what the demo needs


_NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "safetensors", "comfy_kitchen", "scipy"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    for m in [m for m in sys.modules if m.split(".")[0] == "torch"]:
        del sys.modules[m]
    sys.meta_path.insert(0, NoTorch())
    from h3quant.cli import run
    try:
        run(sys.argv[1:])
    finally:
        assert "torch" not in sys.modules
""")


def _no_torch(*args, cwd):
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_inspect_and_validate_run_without_torch(tmp_path):
    from h3quant.synth import synth_checkpoint

    src = tmp_path / "h3.safetensors"
    synth_checkpoint(src, preset="tiny", seed=0)
    for args in (("inspect", src), ("inspect", src, "--layers", "--json"), ("validate", src),
                 ("validate", src, "--json"), ("--help",), ("convert", "--help")):
        res = _no_torch(*args, cwd=tmp_path)
        assert res.returncode == 0, (args, res.stderr[-2000:])
    for args in (("convert", src, tmp_path / "o.safetensors"), ("verify", src),
                 ("plan", src), ("validate", src, "--deep"), ("synth", tmp_path / "s.safetensors")):
        res = _no_torch(*args, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert "needs PyTorch" in res.stderr and "h3quant[torch]" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h3.safetensors"]
