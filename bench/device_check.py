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
  result and the layer's own dequantized weights in fp32.

``--device cpu`` runs the same checks on the CPU (kitchen's ``eager`` backend), a quick smoke
test of this script for machines without a GPU (the test suite does that).
"""

from __future__ import annotations

import argparse
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


def make_files(d: Path, blocks: int) -> dict[str, Path]:
    f = {n: d / f"{n}.safetensors" for n in ("bf16", "int8", "w4a8", "kn", "w4a8-int8")}
    h3q("synth", f["bf16"], "--blocks", blocks)
    h3q("convert", f["bf16"], f["int8"], "--to", "int8-convrot")
    h3q("convert", f["bf16"], f["w4a8"], "--to", "w4a8")
    h3q("convert", f["int8"], f["kn"], "--layout", "npu")
    h3q("convert", f["w4a8"], f["w4a8-int8"], "--to", "int8-convrot")
    return f


def _sqnr(res) -> dict[str, float]:
    return {o.name: o.sqnr_db for o in res.outputs}


def model_check(name, path, ref, device, backend) -> None:
    from h3quant.pipelines.verify import ModelInputs, verify_model

    inputs = ModelInputs(frames=2, height=16, width=16, audio_frames=32, text_tokens=64)
    try:
        dev = verify_model(path, reference=ref, device=device, inputs=inputs, backend=backend)
        cpu = verify_model(path, reference=ref, device="cpu", inputs=inputs)
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
        layer_checks(files, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
