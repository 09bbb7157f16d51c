"""The verdicts of verify and compare on files made by comfy-kitchen's own quantizers, and on
files with planted defects: prints the measured margins (a file against the fresh plain encode
of the reference in its format), the noise floor, and whether every clean file passes and every
defect is flagged, named and ranked below every clean file.

    python bench/bench_verdicts.py [--seeds 10] [--blocks 2 4] [--dir D] [--no-verify]
                                   [--bf16-made FMT ...]

Per seed and block count: a synthetic tiny H3 (seeded Gaussian weights: the figures say how the
formats and the code behave, not how a released H3 looks), six files quantized by comfy-kitchen
(int8-convrot, w4a8, fp8, mxfp8, nvfp4, int4-convrot) and a Q8_0 GGUF written by the gguf
package, and int8-convrot also made by comfy-kitchen from the bf16 weights as stored (in bf16
arithmetic; ``--bf16-made`` picks the formats); then, in nvfp4, int8-convrot and the Q8_0 GGUF,
four defects: one layer's scale x1.5, one layer's rows rolled by one, two blocks' fc1 swapped,
NaN block scales. One ``compare`` per
seed and block count over all of them (one forward, CPU, float32), and ``verify`` (per layer and
block) and ``verify --model`` of every clean file against the reference. Exit 1 if any clean
file fails or is flagged, or any defect is not flagged, named and ranked below the clean files.
Needs comfy-kitchen and gguf (the test extra installs both).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's GGUF writer

# --to name: (comfy-kitchen layout, its keyword arguments, the marker ComfyUI reads)
KITCHEN = {
    "int8-convrot": ("TensorWiseINT8Layout", {"per_channel": True, "convrot": True,
                                              "convrot_groupsize": 256},
                     {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}),
    "w4a8": ("AsymW4A8Int8Layout", {},
             {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}),
    "fp8": ("TensorCoreFP8Layout", {}, {"format": "float8_e4m3fn"}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}),
    "int4-convrot": ("TensorCoreConvRotW4A4Layout", {},
                     {"format": "convrot_w4a4", "convrot_groupsize": 256}),
}
LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
DEFECTS = ("scale x1.5", "rows rolled", "blocks swapped", "NaN block scales")
DEFECT_FORMATS = ("nvfp4", "int8-convrot", "Q8_0")
SMALL = dict(frames=1, height=4, width=4, audio_frames=2, text_tokens=4)


def _linears(tensors: dict) -> list[str]:
    return sorted(k[:-len(".weight")] for k in tensors if k.endswith(".weight")
                  and k.startswith("blocks.") and k[:-len(".weight")].endswith(LINEARS))


def kitchen_file(src: Path, out: Path, fmt: str, *, from_float32: bool = True) -> Path:
    """Every block linear of ``src`` quantized by comfy-kitchen's layout (eager backend, from
    the weight in float32, as convert reads it, or in the file's own dtype with
    ``from_float32=False``, as a publisher quantizing bf16 weights does) with ComfyUI's marker
    tensor."""
    import json

    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor
    from safetensors.torch import load_file, save_file

    layout, kw, marker = KITCHEN[fmt]
    t = load_file(str(src))
    for name in _linears(t):
        w = t.pop(name + ".weight")
        w = w.float() if from_float32 else w
        with ck.registry.use_backend("eager"):
            qt = QuantizedTensor.from_float(w, layout, **kw)
        for k, v in qt.state_dict(name + ".weight").items():
            key = k.replace(".weight.", ".", 1) if k.startswith(name + ".weight.") else k
            t[key] = v.contiguous()
        t[name + ".comfy_quant"] = torch.tensor(list(json.dumps(marker).encode()),
                                                dtype=torch.uint8)
    save_file(t, str(out))
    return out


def _edit_safetensors(src: Path, out: Path, defect: str, fmt: str) -> tuple[Path, list[int]]:
    """``src`` with one planted defect; returns the file and the blocks it is in."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(src))
    layer = "blocks.1.mlp.fc2"
    if defect == "scale x1.5":
        key = f"{layer}.weight_scale_2" if fmt == "nvfp4" else f"{layer}.weight_scale"
        t[key] = (t[key].float() * 1.5).to(t[key].dtype)
        blocks = [1]
    elif defect == "rows rolled":
        t[f"{layer}.weight"] = t[f"{layer}.weight"].roll(1, dims=0).contiguous()
        blocks = [1]
    elif defect == "blocks swapped":
        a, b = "blocks.0.mlp.fc1.", "blocks.1.mlp.fc1."
        for k in [k for k in t if k.startswith(a) and not k.endswith("comfy_quant")]:
            k2 = b + k[len(a):]
            t[k], t[k2] = t[k2], t[k]
        blocks = [0, 1]
    else:  # NaN block scales
        key = f"{layer}.weight_scale"
        raw = t[key].contiguous().view(torch.uint8).clone()
        if fmt == "nvfp4":  # e4m3 NaN bytes in the swizzled block scales
            raw.view(-1)[:4] = 0x7F
        else:
            raw.view(torch.float32).view(-1)[:2] = float("nan")
        t[key] = raw.view(t[key].dtype)
        blocks = [1]
    save_file(t, str(out))
    return out, blocks


def _edit_gguf(src: Path, out: Path, defect: str) -> tuple[Path, list[int]]:
    """The Q8_0 GGUF with one planted defect in its raw blocks (34 bytes: fp16 d, 32 codes)."""
    from h3quant.formats.gguf import GgufFile

    raw = bytearray(src.read_bytes())
    with GgufFile(src) as g:
        def span(name):
            t = g.tensors[name]
            at, n = g.byte_range(name, 0, t.numel)
            return at, n, t.shape

        name = "blocks.1.mlp.fc2.weight"
        at, n, shape = span(name)
        blk = np.frombuffer(bytes(raw[at:at + n]), dtype=np.uint8).reshape(-1, 34).copy()
        blocks = [1]
        if defect == "scale x1.5":
            d = blk[:, :2].copy().view(np.float16)
            blk[:, :2] = (d.astype(np.float32) * 1.5).astype(np.float16).view(np.uint8)
        elif defect == "rows rolled":
            rows = blk.reshape(shape[0], -1)
            blk = np.roll(rows, 1, axis=0).reshape(-1, 34)
        elif defect == "NaN block scales":
            blk[:4, :2] = np.array([np.nan] * 4, np.float16).view(np.uint8).reshape(4, 2)
        if defect != "blocks swapped":
            raw[at:at + n] = blk.tobytes()
        else:
            a0, an, _ = span("blocks.0.mlp.fc1.weight")
            b0, bn, _ = span("blocks.1.mlp.fc1.weight")
            assert an == bn
            raw[a0:a0 + an], raw[b0:b0 + bn] = raw[b0:b0 + bn], raw[a0:a0 + an]
            blocks = [0, 1]
    out.write_bytes(bytes(raw))
    return out, blocks


def make_files(d: Path, seed: int, blocks: int,
               bf16_made: tuple[str, ...] = ("int8-convrot",)) -> tuple[Path, dict, dict]:
    """(reference, {name: clean file}, {name: (defect file, its blocks)}). ``bf16_made``: kitchen
    formats also made from the bf16 weights as stored (kitchen then computes in bf16)."""
    from helpers.gguf_files import write_gguf
    from safetensors.torch import load_file

    from h3quant.synth import synth_checkpoint

    ref = d / "bf16.safetensors"
    synth_checkpoint(ref, preset="tiny", blocks=blocks, seed=seed, workers=1)
    clean = {fmt: kitchen_file(ref, d / f"{fmt}.safetensors", fmt) for fmt in KITCHEN}
    for fmt in bf16_made:
        clean[f"{fmt} bf16-made"] = kitchen_file(ref, d / f"{fmt}-bf16-made.safetensors", fmt,
                                                 from_float32=False)
    q8 = d / "Q8_0.gguf"
    write_gguf(load_file(str(ref)), q8, "Q8_0")
    clean["Q8_0"] = q8
    bad = {}
    for fmt in DEFECT_FORMATS:
        for defect in DEFECTS:
            tag = defect.replace(" ", "_").replace(".", "")
            if fmt == "Q8_0":
                bad[f"{fmt} {defect}"] = _edit_gguf(q8, d / f"{fmt}-{tag}.gguf", defect)
            else:
                bad[f"{fmt} {defect}"] = _edit_safetensors(
                    clean[fmt], d / f"{fmt}-{tag}.safetensors", defect, fmt)
    return ref, clean, bad


def _shortfalls(card) -> tuple[float, float]:
    """(worst block-alone, worst output) SQNR of the file minus the fresh encode's (dB)."""
    e = card.expected
    if e is None:
        return math.nan, math.nan
    blk = min(d.local_sqnr_db - e["blocks"][d.block] for d in card.drift)
    out = min(m.sqnr_db - e["outputs"][k] for k, m in card.outputs.items())
    return blk, out


def run_one(seed: int, blocks: int, root: Path, verify: bool, stats: dict,
            bf16_made: tuple[str, ...] = ("int8-convrot",)) -> list[str]:
    from h3quant.pipelines.compare.run import CompareOptions, compare_files
    from h3quant.pipelines.verify.blocks import verify_checkpoint
    from h3quant.pipelines.verify.model import ModelInputs, verify_model

    problems = []
    d = root / f"s{seed}-b{blocks}"
    d.mkdir(parents=True, exist_ok=True)
    ref, clean, bad = make_files(d, seed, blocks, bf16_made)
    inputs = ModelInputs(**SMALL, seed=seed)
    files = [*clean.values(), *(p for p, _ in bad.values())]
    res = compare_files(files, reference=ref,
                        options=CompareOptions(inputs=inputs, device="cpu"))
    cards = {Path(c.facts.path).name: c for c in res.files}
    stats["floor"].append(min(res.floor["video"], res.floor["audio"]))
    worst_clean_rank = 0
    for fmt, p in clean.items():
        c = cards[p.name]
        blk, out = _shortfalls(c)
        stats["clean_block"].append(blk)
        stats["clean_output"].append(out)
        stats["clean_by_fmt"].setdefault(fmt, []).append((blk, out))
        stats["clean_q"].setdefault(fmt, []).append(c.quality_db)
        worst_clean_rank = max(worst_clean_rank, c.rank)
        if c.flags or c.failures:
            problems.append(f"seed {seed} blocks {blocks}: clean {fmt} flagged: "
                            f"{(c.flags + c.failures)[0]}")
        if verify and p.suffix == ".safetensors":
            for name, r in (("verify", verify_checkpoint(p, reference=ref, device="cpu",
                                                        blocks=blocks)),
                            ("verify --model", verify_model(p, reference=ref, device="cpu",
                                                            inputs=inputs))):
                if not r.passed:
                    problems.append(f"seed {seed} blocks {blocks}: clean {fmt} fails {name}: "
                                    f"{r.failures[0]}")
    ranked = [c for c in res.ranked() if Path(c.facts.path).name in
              {p.name for p in clean.values()}]
    qs = [c.quality_db for c in ranked]
    if qs != sorted(qs, reverse=True):
        problems.append(f"seed {seed} blocks {blocks}: clean files not in one-forward order")
    for name, (p, where) in bad.items():
        c = cards[p.name]
        blk, out = _shortfalls(c)
        if not c.failures:
            stats["defect_block"].append((blk, name))
        text = " ".join(c.flags + c.failures)
        named = any(f"block {b}" in text or f"blocks.{b}." in text for b in where)
        if not (c.flags or c.failures):
            problems.append(f"seed {seed} blocks {blocks}: {name} not flagged")
        elif not named:
            problems.append(f"seed {seed} blocks {blocks}: {name} flagged without its block: "
                            f"{text[:120]}")
        if c.rank <= worst_clean_rank:
            problems.append(f"seed {seed} blocks {blocks}: {name} ranked {c.rank}, above a "
                            "clean file")
    return problems


def report(stats: dict, a, out) -> None:
    """The figures so far, to ``out``."""
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    say(f"{len(stats['clean_block'])} clean files ({len(KITCHEN)} kitchen formats from float32 "
        f"weights, {' '.join(a.bf16_made) or 'none'} also from the bf16 weights, a Q8_0 "
        f"GGUF; seeds {a.first_seed}..{a.first_seed + a.seeds - 1}, tiny, blocks {a.blocks}), "
        f"{len(stats['defect_block'])} defect files run (NaN files fail before running)")
    say(f"noise floor (1-ulp inputs, CPU float32): lowest {min(stats['floor']):.1f} dB")
    cb = [x for x in stats["clean_block"] if math.isfinite(x)]
    co = [x for x in stats["clean_output"] if math.isfinite(x)]
    say(f"clean files, block alone minus the fresh encode: worst {min(cb):+.3f} dB, "
        f"best {max(cb):+.3f} dB")
    say(f"clean files, output minus the fresh encode: worst {min(co):+.3f} dB, "
        f"best {max(co):+.3f} dB")
    for fmt, qs in stats["clean_q"].items():
        sf = stats["clean_by_fmt"][fmt]
        say(f"  {fmt:13s} one-forward limiting SQNR {min(qs):6.2f}..{max(qs):6.2f} dB; minus "
            f"the fresh encode: blocks worst {min(b for b, _ in sf):+.3f}, outputs worst "
            f"{min(o for _, o in sf):+.3f} dB")
    db = stats["defect_block"]
    say("defects, worst block alone minus the fresh encode (range over seeds):")
    for kind in sorted({n for _, n in db}):
        vals = [x for x, n in db if n == kind]
        say(f"  {kind:28s} {max(vals):+7.2f} .. {min(vals):+7.2f} dB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--no-verify", action="store_true", help="compare only")
    ap.add_argument("--bf16-made", nargs="*", default=["int8-convrot"], choices=list(KITCHEN),
                    help="kitchen formats also made from the bf16 weights as stored (clean "
                         "files; kitchen then computes in bf16)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    stats: dict = {"floor": [], "clean_block": [], "clean_output": [], "clean_q": {}, "clean_by_fmt": {},
                   "defect_block": []}
    problems: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-verdicts-") as tmp:
        root = a.dir or Path(tmp)
        for blocks in a.blocks:
            for seed in range(a.first_seed, a.first_seed + a.seeds):
                problems += run_one(seed, blocks, root, not a.no_verify, stats,
                                    tuple(a.bf16_made))
                print(f"seed {seed} blocks {blocks}: done ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr)
                report(stats, a, sys.stderr)  # so far
                for p in problems:
                    print("PROBLEM:", p, file=sys.stderr, flush=True)
    report(stats, a, sys.stdout)
    print(f"{time.perf_counter() - t0:.0f} s")
    for p in problems:
        print("PROBLEM:", p)
    print("OK" if not problems else f"{len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
