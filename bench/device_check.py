"""The GPU checks of bench/device_check.sh (run it, not this file, on a CUDA machine).

Prints one line per check: ``PASS name figures``, ``FAIL name figures`` or ``SKIP name: reason``.
The checks, on seeded synthetic files (``h3quant synth``: BF16, then int8-convrot, W4A8 and the
int8 NPU ``kn`` layout converted from it):

- ``model-<fmt>``: ``verify --model`` on ``--device cuda`` (int8 layers forced onto the
  ``torch-int8`` backend, torch._int_mm) and on the CPU, against the BF16 file: both must pass
  and their output SQNRs agree within ``SQNR_SPREAD_DB`` (bf16 activations on the GPU, fp32 on
  the CPU, so they are close, not equal);
- ``model-int8-kitchen``: the same with the automatic backend choice (kitchen when it runs);
- ``layer-<fmt>-kitchen``: one layer through comfy-kitchen's CUDA kernels (``int8_linear``,
  ``w4a8_int8_linear``, forced to kitchen's ``cuda`` backend) against h3quant's torch-int8
  result and the layer's own dequantized weights in fp32;
- ``model-<fmt>`` for every other format h3quant writes (fp8, fp8-e5m2, mxfp8, nvfp4,
  int4-convrot): ``verify --model`` on the device (each layer decoded to the compute dtype, the
  way ComfyUI runs a format without its kernel) and on the CPU, the same agreement rule;
- ``calib-capture``: ``capture`` on the device against ``capture`` on the CPU (the Hessians of
  every linear agree to fp32 rounding), then ``model-<fmt>-calibrated``: ``convert
  --calibration`` (int8-convrot, w4a8, nvfp4, int4-convrot) from the device's statistics,
  run by ``verify --model`` on the device; its SQNR is printed beside the uncalibrated file's
  (synthetic inputs);
- ``calib-capture-tp``: ``capture --tp 1`` on the device (one rank: the process group on the
  device's backend, nccl on CUDA) against the single-process capture there (SKIP where that
  backend is missing);
- ``calib-onepass``: ``convert --calibrate-on`` (int8-convrot, float feedback) on the device
  from the same inputs: every tensor must have the bytes of the two-step file above (capture on
  the device, then ``convert --calibration``), and ``verify --model`` on the device passes.

``--device cpu`` runs the same checks on the CPU (kitchen's ``eager`` backend), a quick smoke
test of this script for machines without a GPU (the test suite does that).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SQNR_SPREAD_DB = 3.0
KITCHEN_REL = 0.02  # kitchen vs h3quant on one layer (activation codes may differ by one)
LAYER = "blocks.0.mlp.fc1"


def line(status: str, name: str, text: str) -> None:
    sep = ": " if status == "SKIP" else " "
    print(f"{status} {name}{sep}{text}", flush=True)


def h3q(*args) -> None:
    subprocess.run([sys.executable, "-m", "h3quant", *map(str, args), "-q"], check=True)


# The formats run through their decode on every device (verify --model's decoded path).
DECODED_TARGETS = ("fp8", "fp8-e5m2", "mxfp8", "nvfp4", "int4-convrot")


def make_files(d: Path, blocks: int) -> dict[str, Path]:
    from h3quant.formats import registry

    f = {n: d / f"{n}.safetensors" for n in ("bf16", "int8", "w4a8", "kn", "w4a8-int8")}
    h3q("synth", f["bf16"], "--blocks", blocks)
    h3q("convert", f["bf16"], f["int8"], "--to", "int8-convrot")
    h3q("convert", f["bf16"], f["w4a8"], "--to", "w4a8")
    h3q("convert", f["int8"], f["kn"], "--layout", "npu")
    h3q("convert", f["w4a8"], f["w4a8-int8"], "--to", "int8-convrot")
    for t in DECODED_TARGETS:
        if t in registry.targets():
            f[t] = d / f"{t}.safetensors"
            h3q("convert", f["bf16"], f[t], "--to", t)
    return f


def calibration_checks(files, d: Path, device: str) -> None:
    """capture on the device vs the CPU; convert --calibration; verify --model on the device."""
    import time

    import torch

    try:
        from h3quant.calibration.recorder import write_inputs
        from h3quant.pipelines.capture import capture_statistics
        from h3quant.runtime.model.model import H3Model
    except ImportError as exc:
        line("SKIP", "calib-capture", f"no calibration in this h3quant ({exc})")
        return
    src = files["bf16"]
    ins = []
    with H3Model.open(src) as m:
        for s in range(4):
            g = torch.Generator().manual_seed(100 + s)
            p = d / f"inputs{s}.safetensors"
            write_inputs(p, torch.randn(1, m.video_channels, 2, 16, 16, generator=g),
                         torch.randn(1, m.audio_channels, 2, 32, generator=g),
                         torch.randn(1, 64, m.text_dim, generator=g), 0.3 + 0.15 * s)
            ins.append(p)
    times = {}
    try:
        for dev in ("cpu", device):
            t0 = time.perf_counter()
            capture_statistics(src, ins, d / f"{dev.replace(':', '')}.stats", device=dev,
                               overwrite=True, predict=False)
            times[dev] = time.perf_counter() - t0
        worst, n = hessian_diff(d / "cpu.stats", d / f"{device.replace(':', '')}.stats")
    except Exception as exc:
        line("FAIL", "calib-capture", f"{type(exc).__name__}: {exc}")
        return
    line("PASS" if worst <= 1e-3 else "FAIL", "calib-capture",
         f"H {device} vs cpu: worst rel diff {worst:.2e} (<= 1e-3) over {n} linears; capture "
         f"{times[device]:.2f} s on {device}, {times['cpu']:.2f} s on cpu")
    stats = d / f"{device.replace(':', '')}.stats"
    capture_tp_check(src, ins, d, device, stats)
    for t, plain in (("int8-convrot", "int8"), ("w4a8", "w4a8"), ("nvfp4", "nvfp4"),
                     ("int4-convrot", "int4-convrot")):
        if plain not in files:
            line("SKIP", f"model-{plain}-calibrated", "this h3quant has no such convert target")
            continue
        out = d / f"{t}-calibrated.safetensors"
        try:
            h3q("convert", src, out, "--to", t, "--calibration", stats)
        except subprocess.CalledProcessError as exc:
            line("FAIL", f"model-{plain}-calibrated", f"convert --calibration failed ({exc})")
            continue
        model_check(f"model-{plain}-calibrated", out, src, device, None,
                    compare_with=files[plain])
    onepass_check(files, ins, d, device)


def hessian_diff(a_path, b_path) -> tuple[float, int]:
    """The worst relative Frobenius difference of two statistics files' Hessians, and how many
    linears they hold."""
    from h3quant.calibration.stats import Statistics

    with Statistics(a_path) as a, Statistics(b_path) as b:
        worst = max(float((a.layers[k].hessian() - b.layers[k].hessian()).norm()
                          / a.layers[k].hessian().norm().clamp_min(1e-30)) for k in a.layers)
        return worst, len(a.layers)


def capture_tp_check(src, ins, d: Path, device: str, stats: Path) -> None:
    """``capture --tp 1`` on the device (one rank: the process group on the device's backend,
    nccl on CUDA, the rank's own device) against the single-process capture there."""
    import time

    from h3quant.errors import H3QuantError
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.runtime.tp.group import backend_for, check_backend

    name = "calib-capture-tp"
    try:
        check_backend(backend_for(device.split(":")[0]))
    except H3QuantError as exc:
        line("SKIP", name, str(exc))
        return
    out = d / "tp1.stats"
    t0 = time.perf_counter()
    try:
        capture_statistics(src, ins, out, device=device, tp=1, overwrite=True, predict=False,
                           tp_timeout_s=120)
        seconds = time.perf_counter() - t0
        worst, n = hessian_diff(stats, out)
    except Exception as exc:
        line("FAIL", name, f"{type(exc).__name__}: {exc}")
        return
    line("PASS" if worst <= 1e-3 else "FAIL", name,
         f"H of tp=1 on {device} vs one process there: worst rel diff {worst:.2e} (<= 1e-3) "
         f"over {n} linears; {seconds:.2f} s")


def onepass_check(files, ins, d: Path, device: str) -> None:
    """convert --calibrate-on on the device: the two-step file's bytes, and verify --model."""
    from h3quant.formats.container.reader import SafetensorsFile

    src, two = files["bf16"], d / "int8-convrot-calibrated.safetensors"
    out = d / "int8-onepass.safetensors"
    try:
        h3q("convert", src, out, "--to", "int8-convrot", "--device", device, "--calibrate-on",
            *ins)
        with SafetensorsFile(out, mmap=False) as a, SafetensorsFile(two, mmap=False) as b:
            differ = [n for n in a.tensors if n not in b.tensors or a.read_bytes(
                a.tensors[n], 0, a.tensors[n].nbytes) != b.read_bytes(b.tensors[n], 0,
                                                                      b.tensors[n].nbytes)]
            total = len(a.tensors)
    except Exception as exc:  # a failed convert (or no two-step file) is a FAIL line
        line("FAIL", "calib-onepass", f"{type(exc).__name__}: {exc}")
        return
    if differ:
        line("FAIL", "calib-onepass", f"{len(differ)} of {total} tensors differ from capture "
             f"+ convert --calibration on {device} (first {differ[0]})")
        return
    model_check("calib-onepass", out, src, device, None, compare_with=files["int8"],
                note=f"{total} tensors equal the two-step file's")


def _sqnr(res) -> dict[str, float]:
    return {o.name: o.sqnr_db for o in res.outputs}


def model_check(name, path, ref, device, backend, compare_with=None, note: str = "") -> None:
    from h3quant.pipelines.verify import ModelInputs, verify_model

    inputs = ModelInputs(frames=2, height=16, width=16, audio_frames=32, text_tokens=64)
    try:
        dev = verify_model(path, reference=ref, device=device, inputs=inputs, backend=backend)
        cpu = verify_model(path, reference=ref, device="cpu", inputs=inputs)
        plain = None if compare_with is None else verify_model(
            compare_with, reference=ref, device=device, inputs=inputs, backend=backend)
    except Exception as exc:  # a check's failure is a FAIL line, never a traceback
        line("FAIL", name, f"{type(exc).__name__}: {exc}")
        return
    a, b = _sqnr(dev), _sqnr(cpu)
    spread = max(abs(a[k] - b[k]) for k in a)
    ok = dev.passed and cpu.passed and spread <= SQNR_SPREAD_DB
    limit = dev.outputs[0].limit_db
    figs = " ".join(f"{k} {a[k]:.2f}/{b[k]:.2f}" for k in a)
    backends = ",".join(f"{k}x{v}" for k, v in sorted(dev.backends.items()))
    line("PASS" if ok else "FAIL", name,
         f"SQNR dB {device}/cpu: {figs} (limit {limit:g}; spread {spread:.2f} <= "
         f"{SQNR_SPREAD_DB:g}) backends {backends}"
         + ("" if plain is None else " (uncalibrated on " + device + ": " + " ".join(
             f"{k} {v:.2f}" for k, v in _sqnr(plain).items()) + ")")
         + (f"; {note}" if note else "")
         + ("" if dev.passed and cpu.passed else f" failures {dev.failures + cpu.failures}"))


def _rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layer_checks(files, device: str) -> None:
    import torch

    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.layers import scan_checkpoint
    from h3quant.runtime.loader import load_layer
    from h3quant.runtime.model.block import quantized_linear

    try:
        import comfy_kitchen as ck
    except ImportError as exc:
        for fmt in ("int8", "w4a8"):
            line("SKIP", f"layer-{fmt}-kitchen", f"comfy_kitchen not importable ({exc})")
        return
    kit = "cuda" if device.startswith("cuda") else "eager"
    dtype = torch.bfloat16 if kit == "cuda" else torch.float32
    for fmt in ("int8", "w4a8"):
        name = f"layer-{fmt}-kitchen"
        with Checkpoint(files[fmt]) as ckpt:
            scan = scan_checkpoint(ckpt)
            layer = load_layer(ckpt, scan.layers[LAYER])
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, layer.in_features, generator=g).to(dtype)
            ref = x.float() @ layer.dequantize(torch.float32).t()
            if layer.bias is not None:
                ref = ref + layer.bias.float()
            ours = quantized_linear(layer, device=device, backend="torch-int8",
                                    compute_dtype=dtype)
            with torch.no_grad():
                y_h3 = ours(x.to(device))
            t = {k: v.to(device) for k, v in layer.tensors.items()}
            bias = t.get("bias")
            try:
                with ck.registry.use_backend(kit), torch.no_grad():
                    if fmt == "int8":
                        y_ck = ck.int8_linear(x.to(device), t["weight"], t["weight_scale"], bias,
                                              dtype, convrot=True, convrot_groupsize=256)
                    else:
                        y_ck = ck.w4a8_int8_linear(
                            x.to(device), t["weight"], t["weight_s_rel"], t["weight_s_channel"],
                            codebook=t.get("weight_codebook"), bias=bias, group_size=16,
                            convrot_groupsize=256, out_dtype=dtype)
            except Exception as exc:
                line("SKIP", name, f"comfy-kitchen's {kit} backend refused it: "
                     f"{type(exc).__name__}: {exc}")
                continue
        d, e_h3, e_ck = _rel(y_ck, y_h3), _rel(y_h3, ref), _rel(y_ck, ref)
        limit = 0.05  # against the file's own weights in fp32: activation rounding only
        ok = d <= KITCHEN_REL and e_h3 <= limit and e_ck <= limit
        line("PASS" if ok else "FAIL", name,
             f"kitchen {kit} vs h3quant torch-int8 rel {d:.2e} (<= {KITCHEN_REL:g}); vs its "
             f"weights in fp32: h3quant {e_h3:.4f} kitchen {e_ck:.4f} (<= {limit:g}); {LAYER} "
             f"[{layer.out_features}x{layer.in_features}] {dtype}")


def compare_check(files, device: str) -> None:
    """The quality card on the device against the same card on the CPU: int8 and W4A8 against
    the float file, 2 sampler steps; each file's final-latent SQNR within 3 dB of the CPU's and
    the same ranking."""
    def card(dev):
        out = subprocess.run([sys.executable, "-m", "h3quant", "compare", str(files["int8"]),
                              str(files["w4a8"]), "--reference", str(files["bf16"]), "--steps",
                              "2", "--device", dev, "--no-frontier", "--json"],
                             check=True, capture_output=True, text=True).stdout
        recs = [r for r in json.loads(out)["records"] if r.get("role") == "file"]
        return {Path(r["path"]).stem: (r["rank"], r["quality_db"], r["step_seconds"]) for r in recs}

    dev, cpu = card(device), card("cpu")
    spread = max(abs(dev[n][1] - cpu[n][1]) for n in cpu)
    ok = set(dev) == set(cpu) and all(dev[n][0] == cpu[n][0] for n in cpu) and spread <= 3.0
    line("PASS" if ok else "FAIL", "compare",
         " ".join(f"{n} rank {dev[n][0]}/{cpu[n][0]} final {dev[n][1]:.2f}/{cpu[n][1]:.2f} dB "
                  f"{dev[n][2]:.3f}/{cpu[n][2]:.3f} s/step" for n in sorted(cpu))
         + f" ({device}/cpu; spread {spread:.2f} <= 3)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=2)
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        line("SKIP", "device-checks", f"torch {torch.__version__} sees no CUDA device")
        return 0
    with tempfile.TemporaryDirectory(prefix="h3q-devcheck-") as tmp:
        files = make_files(Path(tmp), args.blocks)
        forced = "torch-int8"
        model_check("model-int8", files["int8"], files["bf16"], args.device, forced)
        model_check("model-w4a8", files["w4a8"], files["bf16"], args.device, forced)
        model_check("model-kn", files["kn"], files["bf16"], args.device, forced)
        model_check("model-w4a8-as-int8", files["w4a8-int8"], files["bf16"], args.device,
                    forced)
        if args.device.startswith("cuda"):
            model_check("model-int8-kitchen", files["int8"], files["bf16"], args.device, None)
        for t in DECODED_TARGETS:
            if t in files:
                model_check(f"model-{t}", files[t], files["bf16"], args.device, None)
            else:
                line("SKIP", f"model-{t}", "this h3quant has no such convert target")
        layer_checks(files, args.device)
        compare_check(files, args.device)
        calibration_checks(files, Path(tmp), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
