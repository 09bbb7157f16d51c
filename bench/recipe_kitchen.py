"""A recipe file converted in one pass at full H3 dimensions, then every layer read back through
comfy-kitchen (the loader code ComfyUI uses) as its marker says. Prints one line per layer
(format from the marker, kitchen's dequantization against the float source) and a verdict; exit
1 if any layer is read otherwise than its recipe rule says or decodes outside its format's error.

usage: python bench/recipe_kitchen.py [--preset full|tiny] [--blocks N] [--dir D] [--workers W]
  python bench/recipe_kitchen.py --preset full --blocks 1     # ~3 min on 2 cores, ~4 GB disk
Needs comfy-kitchen (the test extra installs it). Synthetic weights (seeded Gaussians).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The recipe, and what each rule means on disk, written out here (not taken from h3quant):
# (layer regex, FORMAT, marker format, convrot, convrot group size); first match wins.
RULES = [
    (r"attn\.qkv_proj", "int8-convrot", "int8_tensorwise", True, 256),
    (r"attn\.out_proj", "int8", "int8_tensorwise", False, None),
    (r"mlp\.fc2", "int8-convrot:g=64", "int8_tensorwise", True, 64),
    (r"mlp\.fc1", "w4a8", "asym_w4a8_int8", True, 256),
]
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def _recipe(path: Path) -> None:
    rules = []
    for regex, fmt, *_ in RULES:
        name, _, opt = fmt.partition(":")
        rule = {"layer": regex, "format": name}
        if opt:
            key, _, value = opt.partition("=")
            rule[key] = int(value)
        rules.append(rule)
    path.write_text(json.dumps({"rules": rules}, indent=1))


def _expect(layer: str):
    for regex, fmt, marker, convrot, group in RULES:
        if re.search(regex, layer):
            return fmt, marker, convrot, group
    raise SystemExit(f"no rule for {layer}")


def _kitchen_read(ckpt, layer: str, marker: dict, w):
    """Dequantize one layer with comfy-kitchen's layout class for its marker's format."""
    import torch
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout

    q = ckpt.read(layer + ".weight")
    if marker["format"] == "int8_tensorwise":
        convrot = bool(marker.get("convrot"))
        group = marker.get("convrot_groupsize", 256)
        params = TensorWiseINT8Layout.Params(
            scale=ckpt.read(layer + ".weight_scale"), orig_dtype=torch.float32,
            orig_shape=tuple(q.shape), convrot=convrot, convrot_groupsize=group)
        deq = QuantizedTensor(q, "TensorWiseINT8Layout", params).dequantize()
        fresh = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True,
                                           convrot=convrot, convrot_groupsize=group)
        # kitchen's own encoder gives the same codes, and they decode to the same weights
        same = bool(torch.equal(fresh._qdata, q) and torch.equal(fresh.dequantize(), deq))
        return deq, same
    n, half = q.shape
    params = AsymW4A8Int8Layout.Params(
        scale=ckpt.read(layer + ".weight_s_rel"), orig_dtype=torch.float32,
        orig_shape=(n, 2 * half), s_channel=ckpt.read(layer + ".weight_s_channel"),
        codebook=ckpt.read(layer + ".weight_codebook"), group_size=marker["group_size"],
        convrot_groupsize=marker["convrot_groupsize"])
    return QuantizedTensor(q, "AsymW4A8Int8Layout", params).dequantize(), None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["tiny", "full"], default="full")
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="h3q-recipe-"))
    work.mkdir(parents=True, exist_ok=True)
    src, out, recipe = work / "bf16.safetensors", work / "mixed.safetensors", work / "r.json"
    h3q = [sys.executable, "-m", "h3quant"]
    if not src.exists():
        subprocess.run(h3q + ["synth", str(src), "--preset", args.preset, "--blocks",
                              str(args.blocks), "--seed", "5", "-q"], check=True)
    _recipe(recipe)
    t0 = time.perf_counter()
    subprocess.run(h3q + ["convert", str(src), str(out), "--recipe", str(recipe), "--overwrite",
                          "--workers", str(args.workers), "-q", "--no-report"], check=True)
    print(f"convert --recipe ({args.preset}, {args.blocks} blocks): one pass in "
          f"{time.perf_counter() - t0:.1f} s, {out.stat().st_size / 1e6:.2f} MB")

    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.formats.markers import parse_marker_bytes

    bad = 0
    with Checkpoint(src) as a, Checkpoint(out) as b:
        for i in range(args.blocks):
            for lin in LINEARS:
                layer = f"blocks.{i}.{lin}"
                fmt, want, convrot, group = _expect(layer)
                marker = parse_marker_bytes(bytes(b.read_bytes(layer + ".comfy_quant")))
                if want == "int8_tensorwise":
                    c = bool(marker.get("convrot"))
                    got = (marker["format"], c, marker.get("convrot_groupsize") if c else None)
                    exp = (want, convrot, group if convrot else None)
                else:
                    got = (marker["format"], marker.get("convrot_groupsize"))
                    exp = (want, group)
                w = a.read(layer + ".weight").float()
                deq, same = _kitchen_read(b, layer, marker, w)
                rel = ((deq.float() - w).norm() / w.norm()).item()
                # the format's error on these weights: synth puts x10..x30 outlier columns in
                # every block linear, which plain int8 (no rotation) pays for as K grows
                limit = {"asym_w4a8_int8": 0.15}.get(marker["format"], 0.02 if convrot else 0.10)
                ok = (got == exp and tuple(deq.shape) == tuple(w.shape) and rel < limit
                      and same is not False)
                bad += not ok
                codes = "" if same is None else f", codes {'==' if same else '!='} kitchen's encoding"
                print(f"{'ok  ' if ok else 'BAD '}{layer} [{w.shape[0]}x{w.shape[1]}] rule {fmt}: "
                      f"marker {marker['format']} convrot={marker.get('convrot')} "
                      f"g={marker.get('convrot_groupsize')}; kitchen rel err {rel:.4f} "
                      f"(< {limit}){codes}")
    print("verdict:", "PASS" if not bad else f"FAIL ({bad} layers)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
