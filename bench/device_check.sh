#!/usr/bin/env bash
# The GPU checks of h3quant, in one run (under 9 minutes on one NVIDIA GPU), from a bare checkout.
#
#   bash bench/device_check.sh            # on a machine with an NVIDIA GPU
#   bash bench/device_check.sh --dry-run  # set-up decisions only: every check SKIPs
#
# Prints one line per check: "PASS name figures", "FAIL name figures" or "SKIP name: reason",
# and exits 0 unless a check FAILs (1). On a machine without CUDA every check is a SKIP line and
# the exit status is 0, within a second (no torch is imported to find that out).
#
# Checks: the test suite's CUDA and comfy-kitchen tests (they use simulated CUDA devices, so
# they run the same with or without a GPU; here on the GPU machine's own torch), then
# bench/device_check.py: verify --model on cuda against cpu on synthetic int8, W4A8, int8 "kn"
# (NPU layout) and W4A8-converted-to-int8 files, and one layer through comfy-kitchen's CUDA
# kernels against h3quant's torch._int_mm path, the quality card (compare) on the device against
# the CPU, and calibration: capture on the device against the CPU, capture --tp 1 on the device
# (one rank on nccl) against one process there, convert --calibration, and
# the one pass (convert --calibrate-on --device cuda) against capture + convert --calibration.
#
# Set-up, offline first (a GPU machine may reach no package index):
#   - Python: $H3Q_PYTHON, else the first of python3, /opt/torch/.venv/bin/python3 whose torch
#     sees a CUDA device (torch is never installed: a GPU machine brings its own CUDA build).
#     A virtual environment .dc-venv/ over its packages (--system-site-packages) gets h3quant
#     installed editable without the network (pip --no-index --no-build-isolation) when its
#     torch still sees CUDA; else that python runs h3quant from the checkout (PYTHONPATH).
#     The tests need pytest, hypothesis, safetensors and scipy from that python.
#   - comfy-kitchen (its wheels are per Python version): used if importable; else
#     .whl/comfy_kitchen-trimmed.tar.gz is unpacked into /tmp/h3q-dc-site (the 0.2.40 cp312
#     wheel is 68 MB, mostly a ROCm library; `bash bench/device_check.sh --pack-kitchen WHEEL`
#     writes that file without it, small enough to carry); else wheels in .whl/ are installed
#     offline there; else, if an index answers, pip installs it there with constraints.txt;
#     else the kitchen checks SKIP.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
CHECKS="tests-cuda model-int8 model-w4a8 model-kn model-w4a8-as-int8 model-int8-kitchen model-fp8 model-fp8-e5m2 model-mxfp8 model-nvfp4 model-int4-convrot layer-int8-kitchen layer-w4a8-kitchen compare calib-capture calib-capture-tp model-int8-calibrated model-w4a8-calibrated model-nvfp4-calibrated model-int4-convrot-calibrated calib-onepass"

skip_all() {
    for n in $CHECKS; do echo "SKIP $n: $1"; done
    exit 0
}

if [ "${1:-}" = "--pack-kitchen" ]; then  # WHEEL: a trimmed copy to carry to a GPU machine
    wheel=${2:?usage: bash bench/device_check.sh --pack-kitchen comfy_kitchen-...whl}
    tmp=$(mktemp -d) && mkdir -p .whl || exit 2
    python3 -m zipfile -e "$wheel" "$tmp" || exit 2
    rm -f "$tmp"/comfy_kitchen/backends/hip/_C*.so  # ROCm only (imported under a ROCm torch)
    tar -czf .whl/comfy_kitchen-trimmed.tar.gz -C "$tmp" . && rm -rf "$tmp" || exit 2
    echo "wrote .whl/comfy_kitchen-trimmed.tar.gz ($(du -k .whl/comfy_kitchen-trimmed.tar.gz | cut -f1) KiB)"
    exit 0
fi
if [ "${1:-}" = "--dry-run" ]; then
    skip_all "dry run (nothing was run)"
fi
# H3Q_DC_DEVICE=cpu runs every step on the CPU instead (a rehearsal of this script where there
# is no GPU: the figures then say nothing about CUDA)
DEV=${H3Q_DC_DEVICE:-cuda}
if [ "$DEV" = cuda ]; then
    HAS='sys.exit(0 if torch.cuda.is_available() else 1)'
    if ! ls /dev/nvidia0 >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
        skip_all "no CUDA (no NVIDIA device or driver on this machine)"
    fi
else
    HAS='pass'
fi

PY=""
for cand in ${H3Q_PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    if timeout 120 "$cand" -c "import sys, torch; $HAS" >/dev/null 2>&1; then
        PY=$(command -v "$cand")
        break
    fi
done
if [ -z "$PY" ]; then
    skip_all "no CUDA (no python here has a torch that sees a CUDA device)"
fi

# h3quant over the system packages, without the network. A venv made from a venv's python sees
# the base interpreter's packages, not that venv's: keep .dc-venv only if its torch sees CUDA.
VPY=$PY
if [ -x .dc-venv/bin/python ] || "$PY" -m venv --system-site-packages .dc-venv >/dev/null 2>&1; then
    if timeout 120 .dc-venv/bin/python -c "import sys, torch; $HAS" >/dev/null 2>&1; then
        VPY=$REPO/.dc-venv/bin/python
        "$VPY" -c 'import h3quant' >/dev/null 2>&1 || timeout 120 "$VPY" -m pip install -q \
            --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
    fi
fi
SITE=/tmp/h3q-dc-site  # carried wheels land here (never in the system's packages)
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
if ! "$VPY" -c 'import h3quant.pipelines.verify.model' >/dev/null 2>&1; then
    echo "FAIL setup: h3quant does not import with $VPY: $("$VPY" -c 'import h3quant.pipelines.verify.model' 2>&1 | tail -1)"
    exit 1
fi

if ! "$VPY" -c 'import comfy_kitchen' >/dev/null 2>&1; then
    if ls .whl/comfy_kitchen-trimmed.tar.gz >/dev/null 2>&1; then
        mkdir -p "$SITE" && tar -xzf .whl/comfy_kitchen-trimmed.tar.gz -C "$SITE"
    elif ls .whl/*.whl >/dev/null 2>&1; then
        timeout 120 "$VPY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            .whl/*.whl >/dev/null 2>&1 || true
    elif timeout 20 "$VPY" -m pip download -q --no-deps -d /tmp/h3q-dc-probe \
            comfy-kitchen==0.2.40 >/dev/null 2>&1; then
        timeout 180 "$VPY" -m pip install -q --no-deps --target "$SITE" -c constraints.txt \
            comfy-kitchen >/dev/null 2>&1 || true
    fi
fi
# other carried wheels (pure Python, e.g. gguf for the GGUF tests): installed offline beside it
for w in .whl/*.whl; do
    [ -e "$w" ] || continue
    mod=$(basename "$w" | cut -d- -f1)
    "$VPY" -c "import $mod" >/dev/null 2>&1 || timeout 120 "$VPY" -m pip install -q --no-index \
        --no-deps --no-compile --target "$SITE" "$w" >/dev/null 2>&1 || true
done
echo "info python $VPY torch $("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")' 2>&1 | tail -1) comfy_kitchen $("$VPY" -c 'import comfy_kitchen, importlib.metadata as m; print(m.version("comfy-kitchen"))' 2>/dev/null || echo absent)"

status=0
# The suite's CUDA tests: simulated CUDA devices (StaticProbe) plus comfy-kitchen's kernels as
# an oracle; the guards (ruff, mypy, import-linter) are not part of this run.
out=$(cd "$REPO" && timeout 240 "$VPY" -m pytest -q -p no:cacheprovider -m "not slow" \
    -k "(cuda or kitchen) and not test_guards" tests 2>&1)
rc=$?
summary=$(printf '%s\n' "$out" | grep -E "passed|failed|error" | tail -1)
if [ $rc -eq 0 ]; then
    echo "PASS tests-cuda $summary"
else
    echo "FAIL tests-cuda rc $rc: $summary"
    printf '%s\n' "$out" | grep -E "^(FAILED|ERROR)" | head -10 | sed 's/^/  /'
    status=1
fi

checks=$(cd "$REPO" && timeout 300 "$VPY" bench/device_check.py --device "$DEV" 2>&1)
rc=$?
printf '%s\n' "$checks" | grep -E "^(PASS|FAIL|SKIP) "
if [ $rc -ne 0 ]; then
    echo "FAIL device-checks rc $rc: $(printf '%s\n' "$checks" | tail -3 | tr '\n' ' ')"
    status=1
fi
if printf '%s\n' "$checks" | grep -q "^FAIL "; then
    status=1
fi
exit $status
