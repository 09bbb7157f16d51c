"""bench/device_check.sh stays runnable where there is no GPU: its no-CUDA and dry-run modes, its
kitchen packing, and its checks (bench/device_check.py) rehearsed on the CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.sh"
NAMES = {"tests-cuda", "model-int8", "model-w4a8", "model-kn", "model-w4a8-as-int8",
         "model-int8-kitchen", "model-fp8", "model-fp8-e5m2", "model-mxfp8", "model-nvfp4",
         "model-int4-convrot", "layer-int8-kitchen", "layer-w4a8-kitchen", "compare", "calib-capture",
         "calib-capture-tp", "model-int8-calibrated", "model-w4a8-calibrated",
         "model-nvfp4-calibrated", "model-int4-convrot-calibrated", "calib-onepass"}
HAS_NVIDIA = Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


def sh(*args, cwd=ROOT, env=None, timeout=60):
    return subprocess.run(["bash", str(cwd / "bench" / "device_check.sh"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _skip_lines(out: str) -> dict[str, str]:
    lines = out.strip().splitlines()
    assert lines and all(ln.startswith("SKIP ") for ln in lines), out
    return dict(ln[5:].split(": ", 1) for ln in lines)


def test_dry_run_skips_every_check():
    res = sh("--dry-run")
    assert res.returncode == 0, res.stderr
    assert set(_skip_lines(res.stdout)) == NAMES


@pytest.mark.skipif(HAS_NVIDIA, reason="this machine has an NVIDIA device: the script would run")
def test_without_cuda_every_check_skips_fast():
    res = sh(timeout=20)
    assert res.returncode == 0, res.stderr
    reasons = _skip_lines(res.stdout)
    assert set(reasons) == NAMES and all("no CUDA" in r for r in reasons.values())


def test_pack_kitchen_drops_the_rocm_library(tmp_path):
    (tmp_path / "bench").mkdir()
    shutil.copy(SCRIPT, tmp_path / "bench" / "device_check.sh")
    wheel = tmp_path / "comfy_kitchen-0.0-cp312-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("comfy_kitchen/__init__.py", "comfy_kitchen/backends/cuda/_C.abi3.so",
                     "comfy_kitchen/backends/hip/_C.abi3.so",
                     "comfy_kitchen/backends/hip/__init__.py"):
            z.writestr(name, "x")
    res = sh("--pack-kitchen", str(wheel), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    with tarfile.open(tmp_path / ".whl" / "comfy_kitchen-trimmed.tar.gz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
    assert "comfy_kitchen/backends/cuda/_C.abi3.so" in names
    assert "comfy_kitchen/backends/hip/__init__.py" in names
    assert "comfy_kitchen/backends/hip/_C.abi3.so" not in names


@pytest.mark.slow
def test_the_checks_rehearsed_on_the_cpu():
    """bench/device_check.py with --device cpu: the same checks, CPU against CPU (and
    comfy-kitchen's eager backend), so the script's code paths run without a GPU."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--device",
                          "cpu", "--blocks", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    got = {ln.split(" ", 2)[1].rstrip(":"): ln.split(" ", 1)[0] for ln in lines}
    assert set(got) == NAMES - {"tests-cuda", "model-int8-kitchen"}, res.stdout
    assert all(v == "PASS" for v in got.values()), res.stdout
