"""Benchmark calibration per H3 block against its GEMM floor, on the CPU or a GPU.

    python bench/bench_calib.py [--dims full|tiny] [--rows 8192] [--device cpu|cuda]
                                [--linears attn.qkv_proj ...]
                                [--target int8-convrot|int8|w4a8|nvfp4|int4-convrot]

For each block linear (its real [N, K] at ``--dims``), with synthetic low-rank inputs X
[rows, K] and Gaussian weights (synthetic data: the timings do not depend on the values):

- ``capture``: what ``capture`` adds to the forward per linear, ``H += X^T X`` and the channel
  magnitudes (``calibration.capture.Recording``), against its floor: ``X^T X`` alone (one GEMM);
- ``factor``: the Cholesky factor of the damped inverse Hessian (``gptq.inverse_factor``: a
  float64 Cholesky and a triangular solve of K x K; this IS the floor of that step, timed once);
- ``feedback``: the codec's calibrated encode minus its uncalibrated encode (per-column
  rounding, in-block rank-1 updates, the blocked GEMMs), against its GEMM floor: the same
  blocked products ``Err [N, B] @ U[B, rest]`` alone; ``plain levels``: the feedback itself
  timed directly with per-row int8 levels (on a loaded machine the subtraction is noisy);
- ``gptq``: factor + feedback for the layer, also against one matmul of the same FLOPs as
  GPTQ's ``N K^2`` multiply-adds (``[N, K] @ [K, K]`` in fp32 on the device: the GEMM floor of
  the whole step);
- ``peak statistics``: one block's statistics, 4 K^2 bytes per linear (what capture holds).

Prints per linear and per block (the four linears): seconds and ratio to the floor. Asserts
nothing. The best of ``--repeat`` runs counts for each timing.
"""

from __future__ import annotations

import argparse
import time

import torch

from h3quant.calibration.gptq import BLOCK, inverse_factor
from h3quant.calibration.stats import LayerStats
from h3quant.formats import registry
from h3quant.h3.topology import BLOCK_LINEARS, config_for


def best(fn, repeat, sync):
    out = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out = min(out, time.perf_counter() - t0)
    return out


class Fixed(LayerStats):
    """Statistics whose factor is given (the factor is timed separately)."""

    def __init__(self, u):
        super().__init__("blocks.0.mlp.fc1", u.shape[0], 1 << 30)
        self._u = u

    def factor(self, convrot, group_size):
        return self._u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", choices=["full", "tiny"], default="full")
    ap.add_argument("--rows", type=int, default=8192, help="calibration rows per capture call")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default="int8-convrot",
                    choices=[t for t in registry.targets()
                             if registry.target_codec(t).spec.encoding.calibrates
                             and not registry.target_codec(t).spec.encoding.write_refusal])
    ap.add_argument("--linears", nargs="*", default=list(BLOCK_LINEARS))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = config_for(args.dims)
    print(f"device {dev} ({torch.get_num_threads()} CPU threads), dims {args.dims}, "
          f"rows {args.rows}, target {args.target}, torch {torch.__version__}")
    codec = registry.target_codec(args.target)
    marker = codec.spec.planning.marker(registry.target(args.target), 256)
    tot = {"capture": 0.0, "capture_floor": 0.0, "factor": 0.0, "feedback": 0.0,
           "feedback_plain": 0.0,
           "feedback_floor": 0.0, "gemm_nk2": 0.0, "bytes": 0}
    for name in args.linears:
        n, k = cfg.linear_shape(name)
        g = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(args.rows, 64, device=dev, generator=g)
             @ torch.randn(64, k, device=dev, generator=g)
             + 0.1 * torch.randn(args.rows, k, device=dev, generator=g))
        h = torch.zeros(k, k, device=dev)
        absum = torch.zeros(k, dtype=torch.float64, device=dev)

        def record():
            h.addmm_(x.t(), x)
            absum.add_(x.abs().sum(0, dtype=torch.float64))

        t_cap = best(record, args.repeat, sync)
        t_cap_floor = best(lambda: torch.mm(x.t(), x), args.repeat, sync)
        hh = (x.t() @ x).double()
        x = None  # free it before the factor
        t_fac = best(lambda: inverse_factor(hh), 1, sync)
        u = inverse_factor(hh)
        w = torch.randn(n, k, device=dev, generator=g)

        def floor_gemms():
            err = torch.empty(n, BLOCK, device=dev)
            for i1 in range(0, k, BLOCK):
                i2 = min(k, i1 + BLOCK)
                if i2 < k:
                    torch.mm(err[:, :i2 - i1], u[i1:i2, i2:])

        t_fb_floor = best(floor_gemms, args.repeat, sync)
        t_nk2 = best(lambda: torch.mm(w, u), args.repeat, sync)  # N K^2 multiply-adds
        cal = Fixed(u)
        t_enc_rtn = best(lambda: codec.encoder.encode(w.cpu(), marker, "exact"), 1, sync) \
            if dev.type == "cpu" else 0.0
        s = w.abs().amax(1) / 127.0

        def quantize(v, j):
            c = (v / s).round_().clamp_(-127, 127)
            return c, c * s
        # the error feedback itself with plain per-row levels (what any codec's feedback costs
        # besides its own per-column rounding), timed directly
        t_fb_plain = best(lambda: cal.feedback(w, quantize, convrot=False), 1, sync)
        if dev.type == "cpu":  # the codec's calibrated encode minus its uncalibrated one
            t_fb = best(lambda: codec.encoder.encode(w, marker, "exact", calibration=cal), 1, sync) - t_enc_rtn
        else:  # codecs encode on the CPU
            t_fb = t_fb_plain
        stats_bytes = 4 * k * k
        print(f"{name:15s} N={n:6d} K={k:6d}  capture {t_cap:7.3f} s (floor {t_cap_floor:7.3f}, "
              f"x{t_cap / t_cap_floor:4.2f})  factor {t_fac:7.2f} s  feedback {t_fb:7.2f} s "
              f"(plain levels {t_fb_plain:6.2f} s) "
              f"(GEMM floor {t_fb_floor:6.2f}, x{t_fb / max(t_fb_floor, 1e-9):5.2f})  "
              f"gptq x{(t_fac + t_fb) / max(t_nk2, 1e-9):5.1f} of an N K^2 matmul "
              f"({t_nk2:6.2f} s)  statistics {stats_bytes / 2**20:7.1f} MiB", flush=True)
        for key, v in (("capture", t_cap), ("capture_floor", t_cap_floor), ("factor", t_fac),
                       ("feedback", t_fb), ("feedback_plain", t_fb_plain),
                       ("feedback_floor", t_fb_floor), ("gemm_nk2", t_nk2),
                       ("bytes", stats_bytes)):
            tot[key] += v
        h = hh = u = w = cal = None  # one linear's tensors at a time
    print(f"per block ({len(args.linears)} linears): capture {tot['capture']:.3f} s per "
          f"{args.rows} rows (floor {tot['capture_floor']:.3f}, "
          f"x{tot['capture'] / tot['capture_floor']:.2f}); GPTQ {tot['factor'] + tot['feedback']:.1f} s "
          f"= factor {tot['factor']:.1f} + feedback {tot['feedback']:.1f} (with plain levels "
          f"{tot['feedback_plain']:.1f}; feedback GEMM floor "
          f"{tot['feedback_floor']:.1f}, x{tot['feedback'] / max(tot['feedback_floor'], 1e-9):.2f}; "
          f"N K^2 matmul {tot['gemm_nk2']:.1f} s, GPTQ "
          f"x{(tot['factor'] + tot['feedback']) / max(tot['gemm_nk2'], 1e-9):.1f} of it); "
          f"statistics held {tot['bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
