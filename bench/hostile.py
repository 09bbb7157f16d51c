"""A hostile pass over every command: each case runs ``h3quant`` in a child process under a
memory cap (never above this process's own hard limit) and a timeout, and the table says what
was expected, what happened, the exit status, the child's peak memory and whether the file it
could have damaged is unchanged. Synthetic tiny files only, made here.

    python bench/hostile.py            # prints the table; exit 1 when a row is unexpected
    python bench/hostile.py GGUF HF    # only the rows whose name contains GGUF or HF
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CAP = 4 << 30
TIMEOUT = 120


def cap() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    return min([CAP] + [c for c in (soft, hard) if c != resource.RLIM_INFINITY])


def _limit():
    c = cap()
    resource.setrlimit(resource.RLIMIT_AS, (c, c))


def sha(p) -> str | None:
    p = Path(p)
    if not p.is_file():
        return None
    return hashlib.sha256(p.read_bytes()).hexdigest()


# the child reports its own peak RSS (kB) to a file when it ends, however it ends
_CHILD = ("import os, resource, sys\n"
          "from h3quant.cli import run\n"
          "try:\n    run(sys.argv[1:])\n"
          "finally:\n"
          "    open(os.environ['H3Q_PEAK'], 'w').write(str(resource.getrusage("
          "resource.RUSAGE_SELF).ru_maxrss))\n")


def run(args, stdin=None):
    peak_file = Path(tempfile.mktemp(prefix="h3q-peak-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "H3QUANT_DEBUG": "",
           "H3Q_PEAK": str(peak_file)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, args)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return "timeout", out + err, time.monotonic() - t0, 0.0
    try:
        peak = int(peak_file.read_text()) / 1024
        peak_file.unlink()
    except (OSError, ValueError):
        peak = float("nan")
    return proc.returncode, out + err, time.monotonic() - t0, peak


def sparse(path: Path, entries: dict) -> Path:
    sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    header, off = {}, 0
    for name, (dtype, shape) in entries.items():
        n = sizes[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + off)
    return path


def build(d: Path) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from h3quant.h3.topology import config_for
    from h3quant.synth import synth_checkpoint
    from h3quant.synth.layouts import write_layout
    from h3quant.synth.lora import write_lora

    f = {}
    f["base"] = d / "base.safetensors"
    synth_checkpoint(f["base"], preset="tiny", blocks=1, seed=3, workers=1)
    f["four"] = d / "four.safetensors"
    synth_checkpoint(f["four"], preset="tiny", blocks=2, seed=3, workers=1)
    f["lora"] = d / "lora.safetensors"
    write_lora(str(f["lora"]), config_for("tiny", blocks=1), "comfyui", rank=2, scale=0.01,
               seed=1)
    f["recipe"] = d / "recipe.json"
    f["recipe"].write_text(json.dumps({"rules": [{"layer": "blocks", "format": "bf16"}]}))
    f["fifo"] = d / "fifo.json"
    os.mkfifo(f["fifo"])
    m = "diffusion_model.blocks.0.attn.qkv_proj"
    f["stray"] = sparse(d / "stray.safetensors", {f"{m}.lora_down.weight": ("BF16", [2, 512]),
                                                  f"{m}.lora_up.weight": ("BF16", [1536, 2]),
                                                  "stray": ("F32", [3 << 28])})
    f["rank"] = sparse(d / "rank.safetensors", {f"{m}.lora_down.weight": ("BF16", [65536, 512]),
                                                f"{m}.lora_up.weight": ("BF16", [1536, 65536])})
    f["fp8lora"] = sparse(d / "fp8lora.safetensors", {
        f"{m}.lora_down.weight": ("F8_E4M3", [2, 512]),
        f"{m}.lora_up.weight": ("F8_E4M3", [1536, 2])})
    t = load_file(str(f["lora"]))
    bare = {k[len("diffusion_model."):]: v.clone() for k, v in t.items()}
    f["twice"] = d / "twice.safetensors"
    save_file({**t, **bare}, str(f["twice"]))
    from h3quant.runtime.model import H3Model

    with H3Model.open(f["base"], "cpu") as model:
        vc, ac = model.video_channels, model.audio_channels
    f["lat"] = sparse(d / "lat.safetensors", {"video": ("F32", [1, vc, 1, 8, 8]),
                                              "audio": ("F32", [1, ac, 2, 8]),
                                              "text": ("F32", [1, 16, 1 << 24])})  # 1 GiB
    f["fp8"] = d / "fp8.safetensors"
    write_layout(f["base"], f["fp8"], "comfy", fp8=True)
    t = load_file(str(f["fp8"]))
    s = "blocks.0.attn.qkv_proj.scale_weight"
    t[s] = torch.full_like(t[s], 3e38)
    f["fp8inf"] = d / "fp8inf.safetensors"
    save_file(t, str(f["fp8inf"]))
    f["q"] = d / "q.safetensors"
    subprocess.run([sys.executable, "-m", "h3quant", "convert", f["base"], f["q"],
                    "--no-report", "-q"], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    f["pass"] = d / "pass.json"
    res = subprocess.run([sys.executable, "-m", "h3quant", "plan", f["four"], "--formats",
                          "w4a8", "--json", "-q"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    f["pass"].write_text(res.stdout)
    doc = json.loads(res.stdout)
    doc["sensitivity"]["signal"]["video"] = 0.0
    f["zero"] = d / "zero.json"
    f["zero"].write_text(json.dumps(doc))
    build_round5(d, f)
    return f


L = "blocks.0.mlp.fc1"


def _edit(src: Path, dst: Path, fn) -> Path:
    from safetensors.torch import load_file, save_file

    t = load_file(str(src))
    fn(t)
    save_file(t, str(dst))
    return dst


def build_round5(d: Path, f: dict) -> None:
    """GGUF header bombs, decoded overflow per format, a NaN in a copied tensor, broken files
    for compare, hostile statistics, Hugging Face cache escapes, pickles."""
    import hashlib

    import torch

    from h3quant.testing.hostile_gguf import write_hostile

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    f["gguf"] = write_hostile(d)
    for to in ("int4-convrot", "nvfp4", "mxfp8"):
        f[to] = d / f"{to}.safetensors"
        subprocess.run([sys.executable, "-m", "h3quant", "convert", f["base"], f[to], "--to", to,
                        "--no-report", "-q"], cwd=ROOT, check=True, env=env)

    def setv(name, value):
        return lambda t: t.__setitem__(name, value(t[name]))

    def row(v, i=5):
        def fn(x):
            x = x.clone()
            x[i] = v
            return x
        return fn

    def e8m0(x):
        return torch.full_like(x.view(torch.uint8), 254).view(x.dtype)

    def nan_byte(x):
        raw = x.view(torch.uint8).clone()
        raw.view(-1)[3] = 0x7F
        return raw.view(x.dtype)

    f["over"] = {
        "int4-convrot row scale 3e38": _edit(f["int4-convrot"], d / "o-int4.safetensors",
                                             setv(f"{L}.weight_scale", row(3e38))),
        "nvfp4 weight_scale_2 3e38": _edit(f["nvfp4"], d / "o-nvfp4.safetensors",
                                           setv(f"{L}.weight_scale_2",
                                                lambda x: torch.tensor(3e38))),
        "mxfp8 block scales 254": _edit(f["mxfp8"], d / "o-mxfp8.safetensors",
                                        setv(f"{L}.weight_scale", e8m0)),
    }
    f["copied nan"] = _edit(f["base"], d / "copied-nan.safetensors",
                            setv("audio_patch_proj.bias", row(float("nan"), 0)))
    f["nvfp4 nan"] = _edit(f["nvfp4"], d / "nvfp4-nan.safetensors",
                           setv(f"{L}.weight_scale", nan_byte))
    # statistics: valid X^T X per layer, then one rule broken each
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3quant.calibration.fingerprint import checkpoint_fingerprint
    from h3quant.calibration.stats import LINEARS

    with safe_open(str(f["base"]), "pt") as fh:
        ks = {f"blocks.0.{x}": fh.get_slice(f"blocks.0.{x}.weight").get_shape()[1]
              for x in LINEARS}
    g = torch.Generator().manual_seed(0)
    good = {}
    for k, n in ks.items():
        x = torch.randn(4 * n, n, generator=g)
        good[f"{k}.hessian"], good[f"{k}.absmean"] = (x.t() @ x).contiguous(), x.abs().mean(0)
    meta = {"h3quant.calibration": json.dumps({
        "version": 1, "checkpoint": checkpoint_fingerprint(f["base"]), "blocks": 1,
        "inputs": [], "rows": {k: 4 * n for k, n in ks.items()}, "forward": "float"})}

    def stats(name, fn):
        t = {k: v.clone() for k, v in good.items()}
        fn(t)
        p = d / f"{name}.stats"
        save_file(t, str(p), metadata=meta)
        return p

    def asym(t):
        t[f"{L}.hessian"][3, 5] += 0.5 * float(t[f"{L}.hessian"].diagonal().max())

    def nan_mean(t):
        t[f"{L}.absmean"][7] = float("nan")

    def neg_mean(t):
        t[f"{L}.absmean"][7] = -1.0

    f["stats"] = {"asymmetric H": (stats("asym", asym), "not symmetric"),
                  "NaN mean abs": (stats("nanmean", nan_mean), "non-finite"),
                  "negative mean abs": (stats("negmean", neg_mean), "negative"),
                  "missing H": (stats("noh", lambda t: t.pop(f"{L}.hessian")),
                                ".hessian is missing")}
    # a Hugging Face cache whose entries lead outside their repository folder
    hub = d / "hf" / "hub"
    os.environ["HF_HOME"] = str(d / "hf")
    rev = "0123456789abcdef0123456789abcdef01234567"
    outside = d / "outside" / "transformer"
    outside.mkdir(parents=True)
    (outside / "h3.safetensors").write_bytes(f["base"].read_bytes())
    for repo, how in (("Hf/Plain", "plain"), ("Hf/Refs", "refs"), ("Hf/Sub", "sub"),
                      ("Hf/Link", "link")):
        r = hub / ("models--" + repo.replace("/", "--"))
        snap = r / "snapshots" / rev / "transformer"
        (r / "blobs").mkdir(parents=True)
        (r / "refs").mkdir()
        (r / "refs" / "main").write_text(rev)
        data = f["base"].read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (r / "blobs" / digest).write_bytes(data)
        if how == "sub":
            snap.parent.mkdir(parents=True)
            snap.symlink_to(outside, target_is_directory=True)
            continue
        snap.mkdir(parents=True)
        if how == "link":
            (snap / "h3.safetensors").symlink_to(outside / "h3.safetensors")
        else:
            (snap / "h3.safetensors").symlink_to(Path("../../..") / "blobs" / digest)
        if how == "refs":
            (r / "refs" / "main").write_text(os.path.relpath(outside.parent, r / "snapshots"))
    f["pt"] = d / "model.pt"
    torch.save({"w": torch.zeros(3)}, f["pt"])
    f["ckpt"] = d / "old.ckpt"
    torch.save({"w": torch.zeros(3)}, f["ckpt"], _use_new_zipfile_serialization=False)


def cases(f: dict, d: Path):
    o = d / "out.safetensors"
    b = f["base"]
    c = [
        # (case, args, expected exit, expected words, the file that must stay unchanged)
        ("OUT = the LoRA", ["convert", b, f["lora"], "--lora", f["lora"], "--overwrite"], 2,
         "LoRA", f["lora"]),
        ("--report = the LoRA", ["convert", b, o, "--lora", f["lora"], "--report", f["lora"],
                                 "--overwrite"], 2, "LoRA", f["lora"]),
        ("OUT = the recipe", ["convert", b, f["recipe"], "--recipe", f["recipe"],
                              "--overwrite"], 2, "recipe", f["recipe"]),
        ("--out = --from", ["plan", f["four"], "--from", f["pass"], "--target-sqnr", "20",
                            "--out", f["pass"], "--overwrite"], 2, "reads", f["pass"]),
        ("--plot = --inputs", ["verify", f["q"], "--model", "--inputs", f["lat"], "--plot",
                               f["lat"], "--overwrite"], 2, "reads", f["lat"]),
        ("recipe from a FIFO", ["convert", b, o, "--recipe", f["fifo"]], 2, "FIFO", None),
        ("recipe = /dev/zero", ["convert", b, o, "--recipe", "/dev/zero"], 2, "device", None),
        ("--from /dev/zero", ["plan", b, "--from", "/dev/zero"], 2, "regular", None),
        ("LoRA + 3 GB stray tensor", ["convert", b, o, "--lora", f["stray"], "--to", "bf16"], 1,
         "no LoRA pair", f["stray"]),
        ("LoRA rank 65536", ["convert", b, o, "--lora", f["rank"]], 1, "rank", None),
        ("LoRA stored as fp8", ["convert", b, o, "--lora", f["fp8lora"], "--to", "bf16"], 1,
         "F8_E4M3", None),
        ("LoRA under 2 spellings", ["convert", b, o, "--lora", f["twice"], "--to", "bf16"], 1,
         "targeted twice", f["twice"]),
        ("--inputs text width 2^24", ["verify", f["q"], "--model", "--inputs", f["lat"],
                                      "--depth", "1"], 2, "text has", None),
        ("--layer (.|.|.|.)*Z$", ["convert", b, o, "--layer", "(.|.|.|.)*Z$=bf16",
                                  "--dry-run"], 2, "rule 1", None),
        ("--include (x+x+)+y", ["convert", b, o, "--include", "(x+x+)+y", "--dry-run"], 0, "",
         None),
        ("--layer backreference", ["convert", b, o, "--layer", r"(a)\1=bf16", "--dry-run"], 2,
         "backreference", None),
        ("plan --target-sqnr 1e9", ["plan", f["four"], "--from", f["pass"], "--target-sqnr",
                                    "1e9"], 2, "outside", None),
        ("plan --targets -1e9", ["plan", f["four"], "--from", f["pass"], "--frontier",
                                 "--no-measure", "--targets", "-1e9"], 2, "outside", None),
        ("--from zero signal", ["plan", f["four"], "--from", f["zero"], "--target-sqnr", "20"],
         2, "signal", None),
        ("--from of another file", ["plan", b, "--from", f["pass"], "--target-sqnr", "20"], 2,
         "measured on another", None),
        ("fp8 scale 3e38: validate --deep", ["validate", "--deep", f["fp8inf"]], 1, "D106", None),
        ("fp8 scale 3e38: inspect", ["inspect", f["fp8inf"]], 0, "0 errors", None),
        ("valid fp8: inspect", ["inspect", f["fp8"]], 0, "0 errors", None),
        ("valid fp8: validate", ["validate", f["fp8"]], 0, "OK", None),
    ]
    for to in ("bf16", "int8", "int8-convrot", "w4a8"):
        c.append((f"fp8 scale 3e38: convert --to {to}", ["convert", f["fp8inf"], o, "--to", to,
                                                         "--no-report"], 1, "D106", f["fp8inf"]))
    c += [
        ("fp8 scale 3e38: verify --reference", ["verify", f["q"], "--reference", f["fp8inf"],
                                                "--blocks", "1"], 1, "D106", None),
        ("OUT named like staging", ["convert", b, d / ".h3quant-staging-1-x.tmp"], 2,
         "reserved", None),
        ("synth over its own OUT dir?", ["synth", d / "s.safetensors", "--blocks", "1"], 0, "",
         None),
        ("backends", ["backends"], 0, "", None),
        ("demo --blocks 0", ["demo", "--blocks", "0"], 2, "", None),
    ]
    return c + round5(f, d)


GGUF_LIMITS = (10.0, 500.0)  # each hostile GGUF answered in under 10 s and 500 MB


def round5(f: dict, d: Path) -> list:
    o = d / "out.safetensors"
    c: list = []
    for name, p in f["gguf"].items():
        for cmd, want in (("inspect", 2), ("validate", 1), ("convert", 2)):
            args = [cmd, p] + ([o, "--to", "bf16"] if cmd == "convert" else [])
            c.append((f"GGUF {name}: {cmd}", args, want, "malformed GGUF header", p,
                      GGUF_LIMITS))
    for name, p in f["over"].items():
        c.append((f"{name}: validate --deep", ["validate", "--deep", p], 1, "D106", None))
        c.append((f"{name}: convert", ["convert", p, o, "--to", "bf16", "--no-report"], 1,
                  "D106", p))
        c.append((f"{name}: verify", ["verify", p, "--reference", f["base"], "--blocks", "1",
                                      "--tokens", "8"], 1, "FAIL", None))
        c.append((f"{name}: convert, the layer kept", ["convert", p, o, "--to", "int8",
                                                      "--include", r"blocks\.0\.attn\.qkv_proj",
                                                      "--no-report"], 1, "D106", p))
    c.append(("NaN in a copied bias: validate --deep", ["validate", "--deep",
                                                        f["copied nan"]], 1, "D106", None))
    c.append(("NaN in a copied bias: convert", ["convert", f["copied nan"], o, "--to", "int8",
                                                "--no-report"], 1, "D106", f["copied nan"]))
    small = ["--frames", "1", "--height", "4", "--width", "4", "--audio-frames", "2",
             "--text-tokens", "4", "--device", "cpu", "--no-frontier"]
    c.append(("nvfp4 NaN block scale: compare", ["compare", f["nvfp4 nan"], "--reference",
                                                 f["base"], *small], 1, "FAILED", None))
    c.append(("nvfp4 NaN block scale as reference: compare",
              ["compare", f["nvfp4"], "--reference", f["nvfp4 nan"], *small], 1,
              "reference fails", None))
    for name, (p, words) in f["stats"].items():
        for to in ("w4a8", "nvfp4", "awq-w4a16"):
            c.append((f"statistics {name}: convert --to {to}",
                      ["convert", f["base"], o, "--to", to, "--calibration", p, "--no-report"],
                      2, words, p))
        c.append((f"statistics {name}: plan", ["plan", f["base"], "--formats", "int8",
                                                "--calibration", p, "--target-sqnr", "20"],
                  2, words, p))
        c.append((f"statistics {name}: validate", ["validate", p], 1, "K101", p))
    c += [
        ("HF plain reference", ["inspect", "Hf/Plain:transformer"], 0, "", None),
        ("HF refs/main outside", ["inspect", "Hf/Refs:transformer"], 2, "outside the", None),
        ("HF subfolder link outside", ["inspect", "Hf/Sub:transformer"], 2, "outside the",
         None),
        ("HF file link outside", ["inspect", "Hf/Link:transformer"], 2, "outside the", None),
        ("HF root: names the subfolder", ["inspect", "Hf/Plain"], 2, "Hf/Plain:transformer",
         None),
        ("HF subfolder typo: lists them", ["inspect", "Hf/Plain:transfomer"], 2,
         "'transformer'", None),
        ("torch.save zip (.pt): inspect", ["inspect", f["pt"]], 2, "zip archive", None),
        ("legacy pickle (.ckpt): convert", ["convert", f["ckpt"], o], 2, "Python pickle", None),
    ]
    return c


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="h3q-hostile-") as tmp:
        d = Path(tmp)
        f = build(d)
        rows, bad = [], 0
        only = sys.argv[1:]
        for name, args, want, words, victim, *limits in cases(f, d):
            if only and not any(w in name for w in only):
                continue
            before = sha(victim) if victim else None
            code, text, secs, peak = run(args)
            after = sha(victim) if victim else None
            ok = (code == want and (not words or words in text)
                  and "Traceback" not in text and "internal error" not in text
                  and before == after)
            if limits:  # (seconds, MB) the answer must stay under
                ok = ok and secs < limits[0][0] and peak < limits[0][1]
            bad += not ok
            last = [ln for ln in text.strip().splitlines() if ln.strip()]
            observed = (last[-1] if last else "")[:70].replace("|", "/")
            rows.append((name, args[0], want, observed, code, f"{peak:.0f}", f"{secs:.1f}",
                         "-" if victim is None else ("yes" if before == after else "NO"),
                         "ok" if ok else "UNEXPECTED"))
        print(f"memory cap {cap() / 2**30:.1f} GiB (address space), timeout {TIMEOUT} s; "
              "peak = the child's own peak RSS (MB)")
        print("| case | command | expected exit | observed (last line) | exit | peak MB | s | "
              "input unchanged | verdict |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(str(x) for x in r) + " |")
        print(f"\n{len(rows)} cases, {bad} unexpected")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
