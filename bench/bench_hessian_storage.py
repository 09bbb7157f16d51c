"""Compact forms of the statistics' Hessian ``H = X^T X``: their sizes, what each does to the
calibrated bytes and their quality, and the factorisation's peak memory. Prints numbers.

    nice python bench/bench_hessian_storage.py [--dir /tmp/h3hstore] [--blocks 2] [--calls 8]
        [--formats w4a8 int8-convrot nvfp4] [--factor-k 14336] [--skip-quality]
        [--skip-factor]

1. sizes of one block's Hessians at H3's full width (K per linear from the topology) and of 50
   blocks, for each form: float32 whole (statistics versions 1-2), float32 upper triangle
   (version 3), bf16 / fp16 whole and upper triangle;
2. quality, on a synthetic tiny checkpoint (``synth --preset tiny``, random weights; inputs A
   for calibration and B held out, as bench/bench_onepass.py makes them): ``capture`` A and B,
   then per format ``convert --calibration`` with A's statistics as they are (version 3, the
   packed half), written whole (version 2, the float32 reference), rounded through bf16,
   rounded through fp16 (of ``H / rows``: ``H`` itself can pass fp16's 65504 on real inputs;
   error feedback does not depend on ``H``'s scale), and with the factorisation in float32
   instead of float64 (``gptq.inverse_factor`` replaced in this process). For each: the
   tensors whose bytes differ from the reference's; per layer the output SQNR over held-out B
   (``--calibration-heldout``: ``tr(E H_B E^T)`` with B's exact float32 ``H``, float
   activations), mean and worst change against the reference; the whole model with ``verify
   --model --reference`` on B (the runtime path: int8 activations for int8-convrot and w4a8,
   nvfp4 decoded; CPU), mean over B;
3. the factorisation ``inverse_factor`` at ``K = --factor-k`` (a synthetic low-rank ``H``), one
   child process per variant: the steps as earlier versions ran them (a fresh buffer each),
   this version's (one Cholesky of the order-reversed ``H`` and one triangular solve, in place
   where torch allows), and float32: seconds, peak RSS above the child's RSS before the call,
   whether the factor equals the earlier steps' bit for bit, and how far it is from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_onepass import byte_diff, make_inputs
from h3quant.calibration.gptq import damped
from h3quant.errors import H3QuantError
from h3quant.h3.topology import BLOCK_LINEARS, config_for
from h3quant.pipelines.verify.model import ModelInputs, verify_model

FORMS = {"float32 whole (v1-2)": (4, False), "float32 upper half (v3)": (4, True),
         "16-bit whole": (2, False), "16-bit upper half": (2, True)}


def sizes() -> None:
    cfg = config_for("full")
    ks = {lin: cfg.linear_shape(lin)[1] for lin in BLOCK_LINEARS}
    print("\n| form | " + " | ".join(f"{lin} (K={k})" for lin, k in ks.items())
          + " | one block | 50 blocks |")
    print("|---|" + "---:|" * (len(ks) + 2))
    for form, (nbytes, half) in FORMS.items():
        per = {lin: nbytes * (k * (k + 1) // 2 if half else k * k) for lin, k in ks.items()}
        block = sum(per.values())
        print(f"| {form} | " + " | ".join(f"{v / 1e6:.0f} MB" for v in per.values())
              + f" | {block / 1e9:.2f} GB | {50 * block / 1e9:.1f} GB |")


def rewrite(src_stats: Path, out: Path, how: str) -> Path:
    """The statistics of ``src_stats`` (version 3) written whole (``whole``, version 2) or with
    each Hessian rounded through ``bf16`` / ``fp16`` (fp16: of ``H / rows``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3quant.calibration.stats import unpack_upper

    with safe_open(str(src_stats), "pt") as f:
        md = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    meta = json.loads(md["h3quant.calibration"])
    for n in [n for n in tensors if n.endswith(".hessian")]:
        h = tensors[n]
        if how == "whole":
            tensors[n] = unpack_upper(h, tensors[n[:-len(".hessian")] + ".absmean"].numel())
        elif how == "bf16":
            tensors[n] = h.to(torch.bfloat16).float()
        elif how == "fp16":
            h = h / meta["rows"][n[:-len(".hessian")]]
            if float(h.abs().max()) > 65504:
                raise SystemExit(f"{n}: H / rows exceeds fp16's range")
            tensors[n] = h.to(torch.float16).float()
    if how == "whole":
        meta["version"] = 2
    save_file(tensors, str(out), metadata={"h3quant.calibration": json.dumps(meta)})
    return out


def inverse_factor_float32(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The factor computed in float32 (the damping as float64 computes it)."""
    hd = damped(h, damp).to(torch.float32)
    lower = torch.linalg.cholesky(hd)
    del hd
    li = torch.linalg.solve_triangular(lower, torch.eye(lower.shape[0]), upper=False)
    del lower
    return torch.linalg.cholesky(li.t() @ li, upper=True)


def model_sqnr(path, src, inputs) -> dict[str, float]:
    """``verify --model --reference src`` on each held-out call (the runtime path, CPU): the
    mean output SQNR per output."""
    runs = [verify_model(path, reference=src, device="cpu", inputs=ModelInputs.from_file(p))
            for p in inputs]
    return {o.name: statistics.mean(o2.sqnr_db for r in runs for o2 in r.outputs
                                    if o2.name == o.name) for o in runs[0].outputs}


def layer_sqnr(report) -> dict[str, float]:
    rep = report.to_dict()
    layers = rep["layers"] if isinstance(rep["layers"], list) else list(rep["layers"].values())
    return {lay["name"]: lay["calibration"]["output_sqnr_db"]["heldout"] for lay in layers
            if isinstance(lay.get("calibration"), dict)
            and "heldout" in lay["calibration"].get("output_sqnr_db", {})}


def quality(args) -> None:
    import h3quant.calibration.gptq as gptq
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    d = args.dir
    d.mkdir(parents=True, exist_ok=True)
    src = d / "float.safetensors"
    if not (args.reuse and src.exists()):
        synth_checkpoint(src, preset="tiny", blocks=args.blocks, seed=0)
    for sub in ("A", "B"):
        (d / sub).mkdir(exist_ok=True)
    a = make_inputs(d / "A", src, range(args.calls), 64, (16, 16), 32)
    b = make_inputs(d / "B", src, range(100, 103), 40, (12, 20), 24)
    for name, ins in (("A", a), ("B", b)):
        if not (args.reuse and (d / f"{name}.stats").exists()):
            capture_statistics(src, ins, d / f"{name}.stats", predict=False, overwrite=True)
    variants = {"float32 whole (v2, reference)": rewrite(d / "A.stats", d / "A_whole.stats", "whole"),
                "float32 upper half (v3)": d / "A.stats",
                "bf16": rewrite(d / "A.stats", d / "A_bf16.stats", "bf16"),
                "fp16 (H / rows)": rewrite(d / "A.stats", d / "A_fp16.stats", "fp16"),
                "float32 factorisation": d / "A_whole.stats"}
    print(f"\nsynthetic tiny checkpoint, {args.blocks} blocks, {len(a)} calibration calls (A), "
          f"{len(b)} held-out calls (B); CPU")
    print("\n| format | H form | tensors differing from the reference | per-layer SQNR on B: "
          "mean change dB | worst layer change dB | video SQNR dB | audio SQNR dB | "
          "video change dB | audio change dB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    original = gptq.inverse_factor
    for fmt in args.formats:
        ref = None
        for label, stats in variants.items():
            out = d / f"{fmt}_{label.split()[0]}_{label.split()[-1].strip('()')}.safetensors"
            gptq.inverse_factor = inverse_factor_float32 if "factorisation" in label else original
            try:
                rep = convert(src, out, ConvertOptions(
                    target=fmt, calibration=str(stats), calibration_heldout=str(d / "B.stats"),
                    overwrite=True))
            except H3QuantError as exc:  # e.g. a rounded H no longer positive definite
                print(f"| {fmt} | {label} | refused: {str(exc).split(';')[0][:150]} | | | | | | |")
                continue
            finally:
                gptq.inverse_factor = original
            per = layer_sqnr(rep)
            q = model_sqnr(out, src, b)
            if ref is None:
                ref = (out, per, q)
                print(f"| {fmt} | {label} | - | {statistics.mean(per.values()):.3f} (mean) | - "
                      f"| {q['video']:.3f} | {q['audio']:.3f} | - | - |")
                continue
            differ, _ = byte_diff(ref[0], out)
            delta = [per[k] - ref[1][k] for k in per]
            worst = min(delta, key=lambda v: (v, -abs(v)))
            print(f"| {fmt} | {label} | {len(differ)} | {statistics.mean(delta):+.4f} | "
                  f"{worst:+.4f} | {q['video']:.3f} | {q['audio']:.3f} | "
                  f"{q['video'] - ref[2]['video']:+.4f} | {q['audio'] - ref[2]['audio']:+.4f} |")


_CHILD = r"""
import resource, sys, time, hashlib, torch
from h3quant.calibration import gptq
sys.path.insert(0, sys.argv[3])
from bench_hessian_storage import earlier_inverse_factor, inverse_factor_float32
k, how = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
x = torch.randn(k + 64, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
x += 0.05 * torch.randn(k + 64, k, generator=g)
h = x.t() @ x
del x
def rss():
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")).split()[1])
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
before = rss()
t = time.perf_counter()
fn = {"earlier": earlier_inverse_factor, "adopted": gptq.inverse_factor,
      "float32": inverse_factor_float32}[how]
u = fn(h)
dt = time.perf_counter() - t
peak = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1])
digest = hashlib.sha256(u.contiguous().numpy().tobytes()).hexdigest()
torch.save(u, sys.argv[4])
resid = float("nan")
if k <= 8192:  # U^T U is the inverse of the damped H: how far from it
    u64 = u.double()
    resid = float((u64.t() @ u64 @ gptq.damped(h) - torch.eye(k, dtype=torch.float64)).abs().max())
print(dt, (peak - before) * 1024, digest, resid)
"""


def earlier_inverse_factor(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """``inverse_factor`` as earlier versions ran it: a fresh buffer for every step."""
    hd = h.to(torch.float64).clone()
    diag = hd.diagonal()
    diag.add_(damp * float(diag.mean()))
    lower = torch.linalg.cholesky(hd)
    eye = torch.eye(lower.shape[0], dtype=lower.dtype)
    li = torch.linalg.solve_triangular(lower, eye, upper=False)
    hinv = li.t() @ li
    return torch.linalg.cholesky(hinv, upper=True).to(torch.float32)


def factor_memory(k: int) -> None:
    print(f"\nfactorisation of one K = {k} Hessian (synthetic, low rank + noise), one child "
          "process each; unit: one float64 K x K buffer = "
          f"{8 * k * k / 1e9:.2f} GB")
    print("\n| steps | seconds | peak RSS above the start | factor equal to the earlier steps' "
          "| max abs(U - U_earlier) / max abs(U_earlier) | max abs(U^T U H_damped - I) |")
    print("|---|---:|---:|---|---:|---:|")
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("earlier", "adopted", "float32"):
            path = str(Path(tmp) / f"{how}.pt")
            res = subprocess.run([sys.executable, "-c", _CHILD, str(k), how,
                                  str(Path(__file__).parent), path],
                                 capture_output=True, text=True, check=True)
            dt, peak, digest, resid = res.stdout.split()
            u = torch.load(path)
            if first is None:
                first, base = digest, u
            rel = float((u - base).abs().max() / base.abs().max())
            del u
            print(f"| {how} | {float(dt):.1f} | {int(peak) / 1e9:.2f} GB | "
                  f"{'yes' if digest == first else 'no'} | {rel:.1e} | {float(resid):.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/h3hstore"))
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--formats", nargs="*", default=["w4a8", "int8-convrot", "nvfp4"])
    ap.add_argument("--factor-k", type=int, default=14336)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep --dir's checkpoint, inputs and "
                    "statistics from an earlier run (the same --blocks and --calls)")
    ap.add_argument("--skip-factor", action="store_true")
    args = ap.parse_args()
    sizes()
    if not args.skip_quality:
        t = time.perf_counter()
        quality(args)
        print(f"(quality runs: {time.perf_counter() - t:.0f} s)")
    if not args.skip_factor:
        factor_memory(args.factor_k)


if __name__ == "__main__":
    main()
